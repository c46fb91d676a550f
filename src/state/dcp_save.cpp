// [Note: saving DCP] in include/fsdp/state/dcp.h.
#include "fsdp/state/dcp.h"

#include <filesystem>
#include <map>
#include <random>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "agreed_failure.h"
#include "checkpoint_format.h"
#include "checkpoint_writer.h"
#include "comm/object_collectives.h"
#include "core/state_view.h"
#include "dcp_boxes.h"
#include "dcp_metadata.h"
#include "dcp_source.h"
#include "error_message.h"
#include "fsdp/comm/call_label.h"
#include "fsdp/optim/cpu_adam.h"
#include "optim_state.h"
#include "unpickled_dict.h"

namespace fsdp {

namespace dcp_save_detail {

namespace fs = std::filesystem;
namespace dcp = state::dcp;
using json = nlohmann::json;

// One key this rank saves: a tensor's boxes (its pieces) or a value.
struct Saved {
  std::string fqn;
  std::vector<dcp::PathPart> path;
  // More keys of the same values (a tied parameter's other names), with their paths.
  std::vector<std::pair<std::string, std::vector<dcp::PathPart>>> also;
  std::vector<int64_t> size;      // the whole tensor's shape
  at::Tensor flat;                // this rank's elements [begin, end) of the flattened tensor
  int64_t begin = 0, end = 0;
  c10::IValue value;              // a non-tensor value (flat undefined)
};

dcp::PathPart key(std::string k) { return dcp::PathPart{false, std::move(k), 0}; }
dcp::PathPart index(int64_t i) { return dcp::PathPart{true, "", i}; }

// Python's param_group of the optimizer's group g, as get_state_dict gives it (names: FQNs).
std::vector<std::pair<std::string, c10::IValue>> python_group(const torch::optim::Optimizer& opt, size_t g,
                                                             c10::List<std::string> params) {
  const std::string kind = state::optimizer_kind(opt);
  const auto& options = opt.param_groups()[g].options();
  auto tuple = [](double a, double b) { return c10::ivalue::Tuple::create({c10::IValue(a), c10::IValue(b)}); };
  if (kind == "sgd") {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    return {{"lr", o.lr()}, {"momentum", o.momentum()}, {"dampening", o.dampening()},
            {"weight_decay", o.weight_decay()}, {"nesterov", o.nesterov()}, {"maximize", false},
            {"foreach", c10::IValue()}, {"differentiable", false}, {"fused", c10::IValue()}, {"params", params}};
  }
  double b1 = 0, b2 = 0, eps = 0, wd = 0;
  bool amsgrad = false, decoupled = kind == "adamw";
  if (kind == "adam" || kind == "adamw") {
    const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
    std::tie(b1, b2) = o.betas();
    eps = o.eps(), wd = o.weight_decay(), amsgrad = o.amsgrad();
  } else {
    const auto& o = static_cast<const optim::CPUAdamOptions&>(options);
    std::tie(b1, b2) = o.betas();
    eps = o.eps(), wd = o.weight_decay(), amsgrad = o.amsgrad(), decoupled = o.adamw_mode();
  }
  return {{"lr", options.get_lr()}, {"betas", tuple(b1, b2)}, {"eps", eps}, {"weight_decay", wd},
          {"amsgrad", amsgrad}, {"maximize", false}, {"foreach", c10::IValue()}, {"capturable", false},
          {"differentiable", false}, {"fused", c10::IValue()}, {"decoupled_weight_decay", decoupled},
          {"params", params}};
}

// What this rank saves: its writer pieces of every parameter and of their optimizer state,
// and on rank 0 the buffers, the steps and the param_groups.
std::vector<Saved> saved_of(core::detail::StateView& view, torch::optim::Optimizer* opt, const DcpOptions& o) {
  const std::string mk = o.model_key(), ok = o.optim_key();
  const bool lead = view.rank() == 0;
  std::vector<Saved> out;
  std::map<const c10::TensorImpl*, std::string> name_of;
  for (const auto& p : view.local_pieces("save_dcp")) {
    name_of[p.param.unsafeGetTensorImpl()] = p.name;
    if (!p.writer) continue;
    Saved s{mk + "." + p.name, {key(mk), key(p.name)}, {}, p.shape, p.flat(), p.begin, p.end, {}};
    for (const auto& a : p.aliases) s.also.emplace_back(mk + "." + a, std::vector<dcp::PathPart>{key(mk), key(a)});
    out.push_back(std::move(s));
    if (opt == nullptr) continue;
    const auto st = state::get_param_state(*opt, p.param);
    if (!st) continue;
    if (p.begin == 0 && p.end > 0)
      out.push_back(Saved{ok + ".state." + p.name + ".step", {key(ok), key("state"), key(p.name), key("step")}, {},
                          {}, at::scalar_tensor(double(st->step), at::kFloat).view({1}), 0, 1, {}});
    for (const auto& [k, t] : st->tensors)
      out.push_back(Saved{ok + ".state." + p.name + "." + k, {key(ok), key("state"), key(p.name), key(k)}, {},
                          p.shape, t.reshape({-1}), p.begin, p.end, {}});
  }
  if (!lead) return out;
  for (const auto& b : view.module().named_buffers()) {
    const at::Tensor v = b.value().detach().contiguous();
    out.push_back(Saved{mk + "." + b.key(), {key(mk), key(b.key())}, {}, v.sizes().vec(), v.view({-1}), 0, v.numel(),
                        {}});
  }
  if (opt == nullptr) return out;
  for (size_t g = 0; g < opt->param_groups().size(); ++g) {
    c10::List<std::string> params;
    for (const auto& p : opt->param_groups()[g].params()) params.push_back(name_of.at(p.unsafeGetTensorImpl()));
    for (auto& [k, v] : python_group(*opt, g, params)) {
      const std::string fqn = ok + ".param_groups." + std::to_string(g) + "." + k;
      out.push_back(Saved{fqn, {key(ok), key("param_groups"), index(int64_t(g)), key(k)}, {}, {}, {}, 0, 0, v});
    }
  }
  return out;
}

json path_json(const std::vector<dcp::PathPart>& path) {
  json out = json::array();
  for (const auto& p : path) out.push_back(p.is_index ? json(p.index) : json(p.key));
  return out;
}

// Writes this rank's file; returns what rank 0 needs for the metadata, as JSON.
json write_rank_file(const std::string& tmp, int rank, const std::vector<Saved>& saved) {
  const std::string file = "__" + std::to_string(rank) + "_0.distcp";
  state::format::RankFileWriter w(tmp, file);
  json entries = json::array();
  auto put = [&](const std::string& fqn, const c10::IValue& v) {
    const std::vector<char> archive = state::detail::pickle_save_untagged(v);
    w.write_streamed(fqn, "dcp", at::kByte, 0, static_cast<int64_t>(archive.size()),
                     [&](const auto& sink) { sink(archive.data(), archive.size()); });
    return json{{"file", file}, {"offset", w.records().back().offset}, {"length", archive.size()}};
  };
  for (const Saved& s : saved) {
    json e{{"keys", json::array({json{{"fqn", s.fqn}, {"path", path_json(s.path)}}})}};
    for (const auto& [fqn, path] : s.also) e["keys"].push_back({{"fqn", fqn}, {"path", path_json(path)}});
    if (!s.flat.defined()) {
      e["storage"] = put(s.fqn, s.value);
      entries.push_back(e);
      continue;
    }
    e["size"] = s.size;
    e["dtype"] = state::dcp_dtype_name(s.flat.scalar_type());
    e["chunks"] = json::array();
    for (const dcp::Chunk& box : dcp::boxes_of(s.size, s.begin, s.end)) {
      const int64_t first = dcp::runs_of(s.size, box).front().flat - s.begin;
      const at::Tensor values = s.flat.narrow(0, first, dcp::numel_of(box.sizes)).reshape(box.sizes);
      e["chunks"].push_back({{"offsets", box.offsets}, {"sizes", box.sizes},
                             {"storage", put(s.fqn, values.to(at::kCPU).contiguous())}});
    }
    entries.push_back(e);
  }
  w.finish();
  return entries;
}

dcp::StorageInfo storage_of(const json& j) {
  return dcp::StorageInfo{j.at("file").get<std::string>(), j.at("offset").get<int64_t>(),
                          j.at("length").get<int64_t>(), false};
}

std::vector<dcp::PathPart> path_of(const json& j) {
  std::vector<dcp::PathPart> out;
  for (const auto& p : j) out.push_back(p.is_number() ? index(p.get<int64_t>()) : key(p.get<std::string>()));
  return out;
}

// Rank 0: every rank's entries merged into one Metadata (a key's chunks from all ranks).
dcp::Metadata merge(const std::vector<std::string>& parts, const std::string& dir) {
  dcp::Metadata m;
  std::map<std::string, size_t> at;
  auto entry_for = [&](const json& k, const json& e) -> dcp::Entry& {
    const std::string fqn = k.at("fqn").get<std::string>();
    const auto [it, fresh] = at.emplace(fqn, m.entries.size());
    if (fresh) {
      dcp::Entry x;
      x.fqn = fqn;
      x.is_tensor = e.contains("chunks");
      if (x.is_tensor) {
        x.size = e.at("size").get<std::vector<int64_t>>();
        x.dtype = e.at("dtype").get<std::string>();
      }
      x.path = path_of(k.at("path"));
      m.entries.push_back(std::move(x));
    }
    return m.entries[it->second];
  };
  for (const auto& part : parts)
    for (const json& e : json::parse(part))
      for (const json& k : e.at("keys")) {
        dcp::Entry& x = entry_for(k, e);
        if (!x.is_tensor) {
          x.storage.push_back(storage_of(e.at("storage")));
          continue;
        }
        for (const json& c : e.at("chunks")) {
          x.chunks.push_back(
              dcp::Chunk{c.at("offsets").get<std::vector<int64_t>>(), c.at("sizes").get<std::vector<int64_t>>()});
          x.storage.push_back(storage_of(c.at("storage")));
        }
      }
  m.version = "1.0.0";
  m.checkpoint_id = fs::absolute(dir).string();
  std::random_device rd;
  m.save_id = "fsdp-cpp-" + std::to_string(rd()) + std::to_string(rd());
  return m;
}

// Every rank's error, agreed: throws on every rank when any failed, naming the first.
void agree(const comm::ProcessGroup& pg, const std::string& error, const std::string& dir) {
  state::throw_if_any_failed(pg, error, "fsdp: save_dcp('" + dir + "')",
                             "Nothing was published; an earlier '" + dir + "' is unchanged");
}

void write_metadata(const std::string& tmp, const dcp::Metadata& m) {
  state::format::RankFileWriter w(tmp, ".metadata");
  w.write_preamble(dcp::serialize_metadata(m));
  w.finish();
  state::format::fsync_dir(tmp);
}

}  // namespace dcp_save_detail

void save_dcp(FullyShardedBase& model, torch::optim::Optimizer* optimizer, const std::string& dir,
              const DcpOptions& options) {
  namespace d = dcp_save_detail;
  comm::LabelScope label_scope({comm::Phase::kStateDict, "save_dcp"});
  core::detail::StateView view(model);
  const comm::ProcessGroup& pg = view.group();
  const std::string tmp = dir + ".tmp";
  torch::NoGradGuard no_grad;
  // Phase 1: rank 0 makes the empty <dir>.tmp (every rank's files go there).
  std::string error;
  if (pg.rank() == 0) error = state::failure_of([&] {
      d::fs::remove_all(tmp);
      d::fs::create_directories(tmp);
    });
  d::agree(pg, error, dir);
  // Phase 2: every rank writes its file; rank 0 learns what each holds.
  std::string part;
  error = state::failure_of(
      [&] { part = d::write_rank_file(tmp, pg.rank(), d::saved_of(view, optimizer, options)).dump(); });
  d::agree(pg, error, dir);
  const std::vector<std::string> parts = comm::all_gather_object(pg, part);
  // Phase 3: rank 0 writes the metadata and publishes.
  if (pg.rank() == 0) error = state::failure_of([&] {
      d::write_metadata(tmp, d::merge(parts, dir));
      state::publish(tmp, dir);
    });
  d::agree(pg, error, dir);
}

}  // namespace fsdp
