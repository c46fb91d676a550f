#include "fsdp/state/state_dict.h"

#include "fsdp/comm/call_label.h"

#include <fstream>
#include <map>
#include <unordered_map>

#include <torch/serialize.h>
#include <torch/torch.h>

#include "core/state_view.h"
#include "unpickled_dict.h"

namespace fsdp {

namespace {

// LOCAL state dicts: one padded flat shard per unit.
std::string flat_param_key(const std::string& unit_path) {
  return unit_path.empty() ? "flat_param" : unit_path + ".flat_param";
}

const char* name_of(StateDictType t) {
  switch (t) {
    case StateDictType::kFull: return "FULL";
    case StateDictType::kLocal: return "LOCAL";
    case StateDictType::kSharded: return "SHARDED";
  }
  return "?";
}

// A copy of `t`, on the CPU under offload_to_cpu.
at::Tensor offloaded(const at::Tensor& t, const FullStateDictConfig& cfg) {
  return cfg.offload_to_cpu() && !t.device().is_cpu() ? t.to(at::kCPU) : t.clone();
}

StateDict full_state_dict(FullyShardedBase& model, const FullStateDictConfig& cfg) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "full_state_dict"});
  core::detail::StateView view(model);
  view.require_idle("state_dict");
  const bool keep = !cfg.rank0_only() || view.rank() == 0;
  torch::NoGradGuard no_grad;
  // Unit by unit: gather the shards (in their own dtype: the full-precision
  // master values under mixed precision, not the low-precision compute copy),
  // copy out (rank 0 only under rank0_only), free.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> value_of;
  for (size_t u = 0; u < view.num_units(); ++u) {
    const at::Tensor full = view.gather_full(u);
    if (!keep) continue;
    const auto& entries = view.entries(u);
    for (size_t i = 0; i < entries.size(); ++i) {
      const at::Tensor v = view.view_of(u, full, i);
      // offload_to_cpu: the host copy is the only one kept, so a device holds one unit's
      // full values at a time. On the CPU both are a copy.
      value_of[entries[i].param.unsafeGetTensorImpl()] =
          cfg.offload_to_cpu() && !v.device().is_cpu() ? v.to(at::kCPU) : v.clone();
    }
  }
  StateDict out;
  if (!keep) return out;
  for (const auto& p : model.module_ptr()->named_parameters()) {
    auto it = value_of.find(p.value().unsafeGetTensorImpl());
    // Ignored parameters are replicated and full already.
    out.insert(p.key(), it != value_of.end() ? it->second : offloaded(p.value().detach(), cfg));
  }
  for (const auto& b : model.module_ptr()->named_buffers()) out.insert(b.key(), offloaded(b.value().detach(), cfg));
  return out;
}

}  // namespace

StateDictTypeGuard::StateDictTypeGuard(FullyShardedBase& model, StateDictType type, FullStateDictConfig config)
    : model_(&model) {
  auto& selected = core::detail::StateView(model).state_dict_selection();
  previous_ = selected;
  selected = core::detail::StateDictSelection{type, config};
}

StateDictTypeGuard::~StateDictTypeGuard() { core::detail::StateView(*model_).state_dict_selection() = previous_; }

StateDict state_dict(FullyShardedBase& model) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "state_dict"});
  core::detail::StateView view(model);
  const core::detail::StateDictSelection s = view.state_dict_selection();
  if (s.type == StateDictType::kFull) return full_state_dict(model, s.config);
  StateDict out;
  if (s.type == StateDictType::kLocal) {
    view.require_idle("state_dict(LOCAL)");
    for (size_t u = 0; u < view.num_units(); ++u)
      out.insert(flat_param_key(view.unit_path(u)), view.shard(u).clone());
  } else {
    for (const auto& kv : sharded_state_dict(model)) out.insert(kv.key(), kv.value().local);
  }
  for (const auto& b : model.module_ptr()->named_buffers()) out.insert(b.key(), b.value().detach().clone());
  return out;
}

ShardedStateDict sharded_state_dict(FullyShardedBase& model) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "sharded_state_dict"});
  ShardedStateDict out;
  for (const auto& p : core::detail::StateView(model).local_pieces("sharded_state_dict"))
    out.insert(p.name, ShardedEntry{p.flat().clone(), p.shape, p.begin, p.end});
  return out;
}

void load_sharded_state_dict(FullyShardedBase& model, const ShardedStateDict& dict) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "load_sharded_state_dict"});
  const int rank = model.process_group().rank();
  torch::NoGradGuard no_grad;
  for (const auto& p : core::detail::StateView(model).local_pieces("load_sharded_state_dict")) {
    const ShardedEntry* e = dict.find(p.name);
    TORCH_CHECK(e != nullptr, "fsdp: load_sharded_state_dict on rank ", rank, ": missing '", p.name, "'");
    TORCH_CHECK(e->shape == p.shape, "fsdp: load_sharded_state_dict: '", p.name, "' has full shape ",
                c10::IntArrayRef(e->shape), ", the model ", c10::IntArrayRef(p.shape));
    TORCH_CHECK(e->begin <= p.begin && p.end <= e->end && e->local.numel() == e->end - e->begin,
                "fsdp: load_sharded_state_dict on rank ", rank, ": the piece of '", p.name, "' holds elements [",
                e->begin, ", ", e->end, "), this rank needs [", p.begin, ", ", p.end,
                "); a sharded state dict loads into the same layout only (use save_checkpoint/load_checkpoint "
                "to change world size, strategy or wrap policy)");
    p.flat().copy_(e->local.reshape({-1}).slice(0, p.begin - e->begin, p.end - e->begin));
  }
}

void load_state_dict(FullyShardedBase& model, const StateDict& dict) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "load_state_dict"});
  const int rank = model.process_group().rank();
  core::detail::StateView view(model);
  const StateDictType type = view.state_dict_selection().type;
  if (type != StateDictType::kFull) {
    torch::NoGradGuard no_grad;
    auto lookup = [&](const std::string& key, int64_t numel) -> const at::Tensor& {
      const at::Tensor* t = dict.find(key);
      TORCH_CHECK(t != nullptr, "fsdp: load_state_dict(", name_of(type), ") on rank ", rank, ": missing key '", key,
                  "'");
      TORCH_CHECK(t->numel() == numel, "fsdp: load_state_dict(", name_of(type), ") on rank ", rank, ": '", key,
                  "' has ", t->numel(), " elements, this rank holds ", numel,
                  "; LOCAL and SHARDED dicts load into the same world size and layout only");
      return *t;
    };
    if (type == StateDictType::kLocal) {
      view.require_idle("load_state_dict(LOCAL)");
      for (size_t u = 0; u < view.num_units(); ++u) {
        const auto& shard = view.shard(u);
        shard.copy_(lookup(flat_param_key(view.unit_path(u)), shard.numel()));
      }
    } else {
      for (const auto& p : view.local_pieces("load_state_dict(SHARDED)"))
        p.flat().copy_(lookup(p.name, p.end - p.begin).reshape({-1}));
    }
    for (const auto& b : model.module_ptr()->named_buffers()) b.value().copy_(lookup(b.key(), b.value().numel()));
    return;
  }
  auto pieces = view.local_pieces("load_state_dict");
  torch::NoGradGuard no_grad;
  auto lookup = [&](const std::string& key, c10::IntArrayRef shape, at::ScalarType dtype) -> const at::Tensor& {
    const at::Tensor* t = dict.find(key);
    TORCH_CHECK(t != nullptr, "fsdp: load_state_dict on rank ", rank, ": missing key '", key,
                "' (a FULL state dict holds every parameter and buffer of the unwrapped model)");
    TORCH_CHECK(t->sizes() == shape, "fsdp: load_state_dict: '", key, "' has shape ", t->sizes(),
                ", the model expects ", shape);
    TORCH_CHECK(t->scalar_type() == dtype, "fsdp: load_state_dict: '", key, "' is ", t->scalar_type(),
                ", the model expects ", dtype);
    return *t;
  };
  std::set<std::string> known;
  for (const auto& p : pieces) {
    // Tied parameters: any one of the names suffices (a dict from a model that
    // registers the tensor once); names present together must hold equal values.
    std::string name = p.name;
    if (!dict.contains(name))
      for (const auto& a : p.aliases)
        if (dict.contains(a)) {
          name = a;
          break;
        }
    const auto& src = lookup(name, p.shape, p.param.scalar_type());
    for (const auto& a : p.aliases) {
      if (a == name || !dict.contains(a)) continue;
      const auto& other = lookup(a, p.shape, p.param.scalar_type());
      TORCH_CHECK(torch::equal(other, src), "fsdp: load_state_dict on rank ", rank, ": '", a, "' and '", name,
                  "' are one tied parameter in the model but hold different values in the dict; "
                  "drop one of them or make them equal");
    }
    p.flat().copy_(src.reshape({-1}).slice(0, p.begin, p.end));
  }
  for (const auto& p : model.module_ptr()->named_parameters()) known.insert(p.key());
  for (const auto& b : model.module_ptr()->named_buffers()) {
    b.value().copy_(lookup(b.key(), b.value().sizes(), b.value().scalar_type()));
    known.insert(b.key());
  }
  for (const auto& kv : dict)
    TORCH_CHECK(known.count(kv.key()), "fsdp: load_state_dict: unexpected key '", kv.key(),
                "' (not a parameter or buffer of the unwrapped model)");
}

void save_full_state_dict(const StateDict& dict, const std::string& path) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& kv : dict) d.insert(kv.key(), kv.value().detach().cpu().contiguous());
  const std::vector<char> bytes = state::detail::pickle_save_untagged(c10::IValue(d));
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  TORCH_CHECK(out, "fsdp: save_full_state_dict: cannot write '", path, "'");
}

StateDict load_full_state_dict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "fsdp: load_full_state_dict: cannot read '", path, "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return state::detail::unpickled_state_dict("load_full_state_dict", path, [&] { return torch::pickle_load(bytes); });
}

}  // namespace fsdp
