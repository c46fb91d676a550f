#include "fsdp/state/optim_state_dict.h"

#include "fsdp/comm/call_label.h"

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/serialize.h>
#include <torch/torch.h>

#include "comm/object_collectives.h"
#include "core/state_view.h"
#include "fsdp/comm/collectives.h"
#include "optim_state.h"
#include "unpickled_dict.h"

namespace fsdp {

using json = nlohmann::json;
using core::detail::LocalPiece;

namespace {

// The state-tensor kinds any supported optimizer has, in a fixed order (a bitmask
// over this list is what ranks agree on).
const char* const kKinds[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};
constexpr int kNumKinds = 4;

std::vector<OptimStateDict::Group> groups_of(const torch::optim::Optimizer& opt,
                                             const std::map<const c10::TensorImpl*, std::string>& name_of) {
  std::vector<OptimStateDict::Group> out;
  for (const auto& g : opt.param_groups()) {
    OptimStateDict::Group og;
    og.lr = g.options().get_lr();
    for (const auto& p : g.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != name_of.end(), "fsdp: the optimizer holds a tensor of shape ", p.sizes(),
                  " that is not a parameter of the wrapped model; build it on the wrapped model's parameters()");
      og.params.push_back(it->second);
    }
    out.push_back(std::move(og));
  }
  return out;
}

std::map<const c10::TensorImpl*, std::string> names_of(const std::vector<LocalPiece>& pieces) {
  std::map<const c10::TensorImpl*, std::string> m;
  for (const auto& p : pieces) m[p.param.unsafeGetTensorImpl()] = p.name;
  return m;
}

}  // namespace

OptimStateDict full_optim_state_dict(FullyShardedBase& model, const torch::optim::Optimizer& opt, bool rank0_only) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "full_optim_state_dict"});
  const auto& pg = model.process_group();
  const bool keep = !rank0_only || pg.rank() == 0;
  core::detail::StateView view(model);
  auto pieces = view.local_pieces("full_optim_state_dict");
  state::optimizer_kind(opt);  // supported?
  torch::NoGradGuard no_grad;
  OptimStateDict out;
  size_t next = 0;  // pieces are in unit order
  for (size_t u = 0; u < view.num_units(); ++u) {
    const auto& entries = view.entries(u);
    const bool sharded = view.sharded(u);
    const size_t n = entries.size();
    std::vector<std::optional<state::ParamOptimState>> st(n);
    auto agreed = torch::zeros({kNumKinds + 2 * static_cast<int64_t>(n)}, torch::kLong);  // kinds | has | step
    auto* a = agreed.data_ptr<int64_t>();
    for (size_t i = 0; i < n; ++i) {
      st[i] = state::get_param_state(opt, entries[i].param);
      if (!st[i]) continue;
      for (int k = 0; k < kNumKinds; ++k)
        if (st[i]->tensors.count(kKinds[k])) a[k] = 1;
      a[kNumKinds + i] = 1;
      a[kNumKinds + n + i] = st[i]->step;
    }
    if (sharded && pg.size() > 1) comm::all_reduce(pg, agreed, comm::ReduceOp::kMax).wait();
    for (int k = 0; k < kNumKinds; ++k) {
      if (!a[k]) continue;
      at::Tensor full;
      if (sharded) {
        // This rank's chunk of the unit's flat state, then one all-gather.
        const int64_t lo = view.gather_group().rank() * view.chunk_numel(u);  // the shard group (HYBRID_SHARD)
        auto chunk = torch::zeros({view.chunk_numel(u)}, view.flat_options(u));
        for (size_t i = 0; i < n; ++i) {
          const auto& e = entries[i];
          if (!st[i] || e.piece_end <= e.piece_begin || !st[i]->tensors.count(kKinds[k])) continue;
          chunk.slice(0, e.piece_begin - lo, e.piece_end - lo).copy_(st[i]->tensors[kKinds[k]].reshape({-1}));
        }
        full = view.gather_full(u, chunk);
      }
      if (!keep) continue;
      for (size_t i = 0; i < n; ++i) {
        if (!a[kNumKinds + i]) continue;
        const auto& e = entries[i];
        if (sharded) out.state[e.fqn][kKinds[k]] = view.view_of(u, full, i).clone();
        else if (st[i]->tensors.count(kKinds[k])) out.state[e.fqn][kKinds[k]] = st[i]->tensors[kKinds[k]].clone();
      }
    }
    if (keep)
      for (size_t i = 0; i < n; ++i)
        if (a[kNumKinds + i]) out.state[entries[i].fqn]["step"] = torch::tensor(a[kNumKinds + n + i]);
    next += n;
  }
  // Ignored parameters: replicated, full already.
  for (; next < pieces.size(); ++next) {
    if (!keep) break;
    const auto& p = pieces[next];
    auto s = state::get_param_state(opt, p.param);
    if (!s) continue;
    for (const auto& kv : s->tensors) out.state[p.name][kv.first] = kv.second.clone();
    out.state[p.name]["step"] = torch::tensor(s->step);
  }
  if (keep) out.param_groups = groups_of(opt, names_of(pieces));
  return out;
}

OptimStateDict shard_full_optim_state_dict(const OptimStateDict& full, FullyShardedBase& model) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "shard_full_optim_state_dict"});
  auto pieces = core::detail::StateView(model).local_pieces("shard_full_optim_state_dict");
  OptimStateDict out;
  out.param_groups = full.param_groups;
  for (const auto& p : pieces) {
    auto it = full.state.find(p.name);
    if (it == full.state.end()) continue;
    for (const auto& kv : it->second) {
      if (kv.first == "step") {
        out.state[p.name]["step"] = kv.second.clone();
        continue;
      }
      TORCH_CHECK(kv.second.numel() == p.numel, "fsdp: shard_full_optim_state_dict: '", kv.first, "' of '", p.name,
                  "' has ", kv.second.numel(), " elements, the parameter ", p.numel,
                  " (is this a full, name-keyed dict? see rekey_optim_state_dict)");
      out.state[p.name][kv.first] = kv.second.reshape({-1}).slice(0, p.begin, p.end).clone();
    }
  }
  return out;
}

void load_optim_state_dict(FullyShardedBase& model, torch::optim::Optimizer& opt, const OptimStateDict& sharded) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "load_optim_state_dict"});
  auto pieces = core::detail::StateView(model).local_pieces("load_optim_state_dict");
  std::map<const c10::TensorImpl*, const LocalPiece*> piece_of;
  for (const auto& p : pieces) piece_of[p.param.unsafeGetTensorImpl()] = &p;
  auto& groups = opt.param_groups();
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (gi < sharded.param_groups.size()) groups[gi].options().set_lr(sharded.param_groups[gi].lr);
    for (const auto& param : groups[gi].params()) {
      auto pit = piece_of.find(param.unsafeGetTensorImpl());
      TORCH_CHECK(pit != piece_of.end(), "fsdp: load_optim_state_dict: the optimizer holds a tensor that is not a "
                  "parameter of the wrapped model");
      const LocalPiece& p = *pit->second;
      auto it = sharded.state.find(p.name);
      if (it == sharded.state.end()) {
        state::erase_param_state(opt, param);
        continue;
      }
      state::ParamOptimState s;
      for (const auto& kv : it->second) {
        if (kv.first == "step") {
          s.step = static_cast<int64_t>(kv.second.item<double>());
          continue;
        }
        TORCH_CHECK(kv.second.numel() == p.end - p.begin, "fsdp: load_optim_state_dict on rank ",
                    model.process_group().rank(), ": '", kv.first, "' of '", p.name, "' has ", kv.second.numel(),
                    " elements, this rank's piece ", p.end - p.begin,
                    " (shard a full dict with shard_full_optim_state_dict first)");
        s.tensors[kv.first] = kv.second.reshape(param.sizes()).to(param.options().requires_grad(false)).clone();
      }
      state::set_param_state(opt, param, std::move(s));
    }
  }
}

void scatter_full_optim_state_dict(const OptimStateDict& full_on_rank0, FullyShardedBase& model,
                                   torch::optim::Optimizer& opt) {
  const auto& pg = model.process_group();
  auto pieces = core::detail::StateView(model).local_pieces("scatter_full_optim_state_dict");
  // What exists (kinds, steps, groups) travels as one JSON string from rank 0.
  json desc;
  if (pg.rank() == 0) {
    desc["state"] = json::object();
    for (const auto& kv : full_on_rank0.state) {
      json kinds = json::array();
      int64_t step = 0;
      for (const auto& t : kv.second) {
        if (t.first == "step") step = static_cast<int64_t>(t.second.item<double>());
        else kinds.push_back(t.first);
      }
      desc["state"][kv.first] = {{"kinds", kinds}, {"step", step}};
    }
    desc["groups"] = json::array();
    for (const auto& g : full_on_rank0.param_groups) desc["groups"].push_back({{"lr", g.lr}, {"params", g.params}});
  }
  desc = json::parse(comm::broadcast_object(pg, pg.rank() == 0 ? desc.dump() : std::string()));
  OptimStateDict mine;
  for (const auto& g : desc["groups"])
    mine.param_groups.push_back({g["lr"].get<double>(), g["params"].get<std::vector<std::string>>()});
  torch::NoGradGuard no_grad;
  // One parameter and kind at a time: rank 0 broadcasts the full tensor; every
  // rank keeps its piece.
  for (const auto& p : pieces) {
    if (!desc["state"].contains(p.name)) continue;
    const auto& d = desc["state"][p.name];
    mine.state[p.name]["step"] = torch::tensor(d["step"].get<int64_t>());
    for (const auto& k : d["kinds"]) {
      at::Tensor t;
      if (pg.rank() == 0) {
        t = full_on_rank0.state.at(p.name).at(k.get<std::string>()).to(p.param.scalar_type()).contiguous().view({-1});
        TORCH_CHECK(t.numel() == p.numel, "fsdp: scatter_full_optim_state_dict: '", k.get<std::string>(), "' of '",
                    p.name, "' has ", t.numel(), " elements, the parameter ", p.numel);
        t = t.clone();
      } else {
        t = torch::empty({p.numel}, p.param.options().requires_grad(false));
      }
      if (pg.size() > 1) comm::broadcast(pg, t, 0).wait();
      mine.state[p.name][k.get<std::string>()] = t.slice(0, p.begin, p.end).clone();
    }
  }
  load_optim_state_dict(model, opt, mine);
}

OptimStateDict rekey_optim_state_dict(const OptimStateDict& osd, OptimKey to, FullyShardedBase& model,
                                      const torch::optim::Optimizer& opt) {
  auto pieces = core::detail::StateView(model).local_pieces("rekey_optim_state_dict");
  const auto name_of = names_of(pieces);
  std::vector<std::string> names;  // position -> name
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != name_of.end(), "fsdp: rekey_optim_state_dict: the optimizer holds a non-model tensor");
      names.push_back(it->second);
    }
  std::map<std::string, std::string> map;
  for (size_t i = 0; i < names.size(); ++i) {
    if (to == OptimKey::kByPosition) map[names[i]] = std::to_string(i);
    else map[std::to_string(i)] = names[i];
  }
  auto rekey = [&](const std::string& k) {
    auto it = map.find(k);
    TORCH_CHECK(it != map.end(), "fsdp: rekey_optim_state_dict: key '", k, "' is not a ",
                to == OptimKey::kByPosition ? "parameter name" : "position", " of this optimizer");
    return it->second;
  };
  OptimStateDict out;
  for (const auto& kv : osd.state) out.state[rekey(kv.first)] = kv.second;
  for (const auto& g : osd.param_groups) {
    OptimStateDict::Group ng{g.lr, {}};
    for (const auto& k : g.params) ng.params.push_back(rekey(k));
    out.param_groups.push_back(std::move(ng));
  }
  return out;
}

void save_optim_state_dict(const OptimStateDict& osd, const std::string& path) {
  c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
  for (const auto& kv : osd.state) {
    c10::impl::GenericDict per(c10::StringType::get(), c10::AnyType::get());
    for (const auto& t : kv.second) per.insert(t.first, t.second.detach().cpu().contiguous());
    state.insert(kv.first, per);
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const auto& g : osd.param_groups) {
    c10::impl::GenericDict gd(c10::StringType::get(), c10::AnyType::get());
    gd.insert("lr", g.lr);
    c10::List<std::string> params;
    for (const auto& p : g.params) params.push_back(p);
    gd.insert("params", params);
    groups.push_back(gd);
  }
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert("state", state);
  top.insert("param_groups", groups);
  const std::vector<char> bytes = state::detail::pickle_save_untagged(c10::IValue(top));
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(out, "fsdp: save_optim_state_dict: cannot write '", path, "'");
}

OptimStateDict load_optim_state_dict_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "fsdp: load_optim_state_dict_file: cannot read '", path, "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto top = torch::pickle_load(bytes);
  TORCH_CHECK(top.isGenericDict(), "fsdp: '", path, "' is not a dict");
  OptimStateDict out;
  const auto d = top.toGenericDict();
  for (const auto& kv : d.at("state").toGenericDict()) {
    const std::string key = kv.key().isString() ? kv.key().toStringRef() : std::to_string(kv.key().toInt());
    for (const auto& t : kv.value().toGenericDict()) {
      const auto& v = t.value();
      out.state[key][t.key().toStringRef()] =
          v.isTensor() ? v.toTensor() : (v.isInt() ? torch::tensor(v.toInt()) : torch::tensor(v.toDouble()));
    }
  }
  for (const auto& g : d.at("param_groups").toList()) {
    const auto gd = g.get().toGenericDict();
    OptimStateDict::Group og;
    og.lr = gd.at("lr").toDouble();
    for (const auto& p : gd.at("params").toList()) {
      const auto v = p.get();
      og.params.push_back(v.isString() ? v.toStringRef() : std::to_string(v.toInt()));
    }
    out.param_groups.push_back(std::move(og));
  }
  return out;
}

}  // namespace fsdp
