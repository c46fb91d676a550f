// [Note: loading DCP] in include/fsdp/state/dcp.h.
#include "fsdp/state/dcp.h"

#include <map>
#include <memory>
#include <sstream>
#include <unordered_map>

#include <torch/torch.h>

#include "agreed_failure.h"
#include "core/state_view.h"
#include "dcp_source.h"
#include "error_message.h"
#include "fsdp/comm/call_label.h"
#include "load_targets.h"
#include "optim_state.h"

namespace fsdp {

namespace dcp_load_detail {

using state::LoadTarget;

// What a load reads: per target, its model entry; per parameter, its optimizer state entries.
struct DcpPlan {
  std::vector<const state::dcp::Entry*> model;  // per target; nullptr: missing
  std::vector<std::map<std::string, const state::dcp::Entry*>> optim;  // per target: state name -> entry
  std::vector<const state::dcp::Entry*> lr;     // per param group (nullptr: keep the optimizer's)
  std::vector<std::string> missing, unexpected;
};

bool starts_with(const std::string& s, const std::string& head) { return s.compare(0, head.size(), head) == 0; }

using EntryIndex = std::unordered_map<std::string, const state::dcp::Entry*>;

// The metadata's entries by key (Metadata::find searches them one by one).
EntryIndex index_of(const state::dcp::Metadata& m) {
  EntryIndex out;
  for (const auto& e : m.entries) out.emplace(e.fqn, &e);
  return out;
}

const state::dcp::Entry* find(const EntryIndex& index, const std::string& fqn) {
  const auto it = index.find(fqn);
  return it == index.end() ? nullptr : it->second;
}

// The model entry of target t: under its name or any alias; a wrong shape or a non-tensor is an error.
const state::dcp::Entry* model_entry(const EntryIndex& index, const LoadTarget& t, const std::string& prefix,
                                     std::map<std::string, bool>& used) {
  std::vector<std::string> names{t.name};
  names.insert(names.end(), t.aliases.begin(), t.aliases.end());
  const state::dcp::Entry* found = nullptr;
  for (const auto& n : names) {
    const state::dcp::Entry* e = find(index, prefix + n);
    if (e == nullptr) continue;
    used[e->fqn] = true;
    TORCH_CHECK(e->is_tensor, "'", e->fqn, "' is a saved value, not a tensor");
    TORCH_CHECK(e->size == t.shape, "'", e->fqn, "' has shape ", c10::IntArrayRef(e->size), ", the model's '", t.name,
                "' ", c10::IntArrayRef(t.shape));
    if (found == nullptr) found = e;
  }
  return found;
}

// "<optim>.state.<name>.<state>" entries of each parameter: the parameter's name holds dots,
// an optimizer's state names (exp_avg, step, momentum_buffer) do not.
void add_optim_entries(const state::dcp::Metadata& m, const std::vector<LoadTarget>& targets, const std::string& key,
                       DcpPlan& plan) {
  std::map<std::string, size_t> target_of;
  for (size_t t = 0; t < targets.size(); ++t) {
    if (!targets[t].param.defined()) continue;
    target_of[targets[t].name] = t;
    for (const auto& a : targets[t].aliases) target_of[a] = t;
  }
  bool any = false;
  const std::string state_prefix = key + ".state.";
  for (const auto& e : m.entries) {
    if (!starts_with(e.fqn, key + ".")) continue;
    any = true;
    const size_t dot = e.fqn.rfind('.');
    if (!starts_with(e.fqn, state_prefix) || dot < state_prefix.size()) continue;
    const std::string name = e.fqn.substr(state_prefix.size(), dot - state_prefix.size());
    const auto it = target_of.find(name);
    TORCH_CHECK(it != target_of.end(), "'", e.fqn, "' is the optimizer state of '", name,
                "', which is not a parameter of the model");
    TORCH_CHECK(e.is_tensor, "'", e.fqn, "' is a saved value, not a tensor");
    plan.optim[it->second][e.fqn.substr(dot + 1)] = &e;
  }
  TORCH_CHECK(any, "the checkpoint holds no '", key, ".*' keys, so no optimizer state: load without an optimizer, or "
              "set DcpOptions::optim_key to the key the optimizer state was saved under");
}

DcpPlan plan_load(const state::dcp::Metadata& m, const std::vector<LoadTarget>& targets,
                  torch::optim::Optimizer* opt, const DcpOptions& o) {
  DcpPlan plan;
  const EntryIndex index = index_of(m);
  std::map<std::string, bool> used;
  const std::string prefix = o.model_key() + ".";
  for (const auto& t : targets) {
    plan.model.push_back(model_entry(index, t, prefix, used));
    if (plan.model.back() == nullptr) plan.missing.push_back(t.name);
  }
  for (const auto& e : m.entries)
    if (starts_with(e.fqn, prefix) && !used.count(e.fqn)) plan.unexpected.push_back(e.fqn);
  plan.optim.resize(targets.size());
  if (opt != nullptr) {
    state::optimizer_kind(*opt);  // refuses an optimizer whose state the state layer does not know
    add_optim_entries(m, targets, o.optim_key(), plan);
    for (size_t g = 0; g < opt->param_groups().size(); ++g)
      plan.lr.push_back(find(index, o.optim_key() + ".param_groups." + std::to_string(g) + ".lr"));
  }
  TORCH_CHECK(!o.strict() || (plan.missing.empty() && plan.unexpected.empty()),
              "the checkpoint and the model do not match (strict):",
              plan.unexpected.empty() ? "" : " " + std::to_string(plan.unexpected.size()) +
                                                 " key(s) of the checkpoint fill nothing in the model: " +
                                                 state::names_text(plan.unexpected) + ";",
              plan.missing.empty() ? "" : " " + std::to_string(plan.missing.size()) +
                                              " parameter(s) or buffer(s) of the model are not in the checkpoint: " +
                                              state::names_text(plan.missing) + ";",
              " set DcpOptions::model_key to the key the model was saved under, or strict(false)");
  return plan;
}

// One parameter's optimizer state: its pieces of each state tensor, and the step.
int64_t load_param_state(state::DcpSource& src, const LoadTarget& t,
                         const std::map<std::string, const state::dcp::Entry*>& entries,
                         torch::optim::Optimizer& opt) {
  if (entries.empty()) {
    state::erase_param_state(opt, t.param);
    return 0;
  }
  int64_t bytes = 0;
  state::ParamOptimState s;
  for (const auto& [name, e] : entries) {
    if (name == "step") {
      const at::Tensor step = at::empty({1}, at::kDouble);
      bytes += src.read_range(*e, 0, 1, step);
      s.step = static_cast<int64_t>(step.item<double>());
      continue;
    }
    TORCH_CHECK(e->size == t.shape, "'", e->fqn, "' has shape ", c10::IntArrayRef(e->size), ", the parameter '", t.name,
                "' ", c10::IntArrayRef(t.shape));
    const at::Tensor piece = at::empty(t.param.sizes(), t.param.options().requires_grad(false));
    bytes += src.read_range(*e, t.begin, t.end, piece.view({-1}));
    s.tensors[name] = piece;
  }
  state::set_param_state(opt, t.param, std::move(s));
  return bytes;
}

int64_t read_planned(state::DcpSource& src, const DcpPlan& plan, const state::LoadTargets& targets,
                     torch::optim::Optimizer* opt) {
  torch::NoGradGuard no_grad;
  int64_t bytes = 0;
  const auto& list = targets.list();
  for (size_t t = 0; t < list.size(); ++t)
    if (plan.model[t] != nullptr) bytes += src.read_range(*plan.model[t], list[t].begin, list[t].end, list[t].dest);
  targets.finish();
  if (opt == nullptr) return bytes;
  for (size_t t = 0; t < list.size(); ++t)
    if (list[t].param.defined()) bytes += load_param_state(src, list[t], plan.optim[t], *opt);
  for (size_t g = 0; g < plan.lr.size(); ++g)
    if (plan.lr[g] != nullptr) opt->param_groups()[g].options().set_lr(src.read_value(*plan.lr[g]).toDouble());
  return bytes;
}

DcpLoadResult result_of(const DcpPlan& plan, int64_t bytes) {
  DcpLoadResult r;
  r.missing_keys = plan.missing;
  r.unexpected_keys = plan.unexpected;
  r.bytes_read = bytes;
  return r;
}

}  // namespace dcp_load_detail

DcpLoadResult load_dcp(FullyShardedBase& model, torch::optim::Optimizer* optimizer, const std::string& dir,
                       const DcpOptions& options) {
  namespace d = dcp_load_detail;
  comm::LabelScope label_scope({comm::Phase::kStateDict, "load_dcp"});
  core::detail::StateView view(model);
  const comm::ProcessGroup& pg = view.group();
  const state::LoadTargets targets(view.local_pieces("load_dcp"), view.module());
  // Phase 1, every rank on its own: the metadata and the plan; nothing is read yet.
  std::unique_ptr<state::DcpSource> source;
  d::DcpPlan plan;
  std::string error = state::failure_of([&] {
    source = std::make_unique<state::DcpSource>(dir);
    plan = d::plan_load(source->metadata(), targets.list(), optimizer, options);
  });
  const std::string who = "fsdp: load_dcp('" + dir + "')";
  state::throw_if_any_failed(pg, error, who, "Nothing was loaded on any rank");
  // Phase 2: each rank reads the boxes that overlap its pieces.
  int64_t bytes = 0;
  error = state::failure_of([&] { bytes = d::read_planned(*source, plan, targets, optimizer); });
  state::throw_if_any_failed(pg, error, who, "The model holds partly loaded values: load again, or restart");
  return d::result_of(plan, bytes);
}

DcpLoadResult load_dcp(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& dir,
                       const DcpOptions& options) {
  namespace d = dcp_load_detail;
  state::DcpSource source(dir);
  const state::LoadTargets targets(model);
  d::DcpPlan plan;
  const std::string error =
      state::failure_of([&] { plan = d::plan_load(source.metadata(), targets.list(), optimizer, options); });
  TORCH_CHECK(error.empty(), "fsdp: load_dcp('", dir, "'): ", error);
  return d::result_of(plan, d::read_planned(source, plan, targets, optimizer));
}

}  // namespace fsdp
