// Consolidated optimizer state dicts of a ZeroRedundancyOptimizer: each parameter's
// state is assembled from the ranks' pieces ([Note: ZeRO partition layout]), one
// parameter at a time, so the extra memory is one parameter's state.
#include "fsdp/state/zero_state_dict.h"

#include "fsdp/comm/call_label.h"

#include <optional>
#include <unordered_map>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "optim_state.h"

namespace fsdp {

namespace {

// The state tensors the supported optimizers keep, as bits of a mask.
const char* const kStateNames[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};
constexpr int kNumStateNames = 4;

void require_names(const std::vector<optim::ZeroRedundancyOptimizer::TrainableParam>& params, const char* what) {
  for (const auto& p : params)
    TORCH_CHECK(!p.name.empty(), "fsdp::", what,
                ": a trainable parameter has no name; build the ZeroRedundancyOptimizer with "
                "ZeroOptions().module(model.ptr()) so that state dicts key parameters by name");
}

// dtype of the pieces (and so of their state): fp32 masters under mixed precision.
at::ScalarType piece_dtype(const optim::ZeroRedundancyOptimizer& opt, const at::Tensor& param) {
  return opt.options().param_dtype() ? at::kFloat : param.scalar_type();
}

}  // namespace

OptimStateDict consolidate_state_dict(optim::ZeroRedundancyOptimizer& opt, int to) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "consolidate_state_dict"});
  const comm::ProcessGroup& pg = opt.options().process_group();
  TORCH_CHECK(to >= 0 && to < pg.size(), "fsdp::consolidate_state_dict: rank ", to, " is outside group '",
              pg.name(), "' of size ", pg.size());
  const auto params = opt.trainable_parameters();
  require_names(params, "consolidate_state_dict");
  const auto pieces = opt.local_pieces();
  const torch::optim::Optimizer& inner = opt.inner();
  const std::string family = state::optimizer_family(state::optimizer_kind(inner));
  const int64_t np = static_cast<int64_t>(params.size());

  // Which tensors each parameter's state holds and its step: known to the ranks owning
  // a piece (pieces of one parameter are stepped together), 0 elsewhere.
  std::vector<std::optional<state::ParamOptimState>> local(pieces.size());
  std::vector<int> piece_of(np, -1);
  auto facts = torch::zeros({np, 2}, torch::kDouble);
  auto f = facts.accessor<double, 2>();
  for (size_t k = 0; k < pieces.size(); ++k) {
    piece_of[pieces[k].param] = static_cast<int>(k);
    local[k] = state::get_param_state(inner, pieces[k].tensor);
    if (!local[k]) continue;
    int mask = 0;
    for (int j = 0; j < kNumStateNames; ++j)
      if (local[k]->tensors.count(kStateNames[j])) mask |= 1 << j;
    f[pieces[k].param][0] = mask | (1 << kNumStateNames);  // the high bit: "has state"
    f[pieces[k].param][1] = static_cast<double>(local[k]->step);
  }
  if (pg.size() > 1 && np > 0) comm::all_reduce(pg, facts, comm::ReduceOp::kMax).wait();

  OptimStateDict out;
  const bool keep = pg.rank() == to;
  for (int64_t i = 0; i < np; ++i) {
    const int mask = static_cast<int>(f[i][0]);
    if (mask == 0) continue;
    const at::Tensor& param = params[i].param;
    std::map<std::string, at::Tensor> entry;
    if (family == "adam") entry["step"] = torch::tensor(static_cast<int64_t>(f[i][1]), torch::kLong);
    for (int j = 0; j < kNumStateNames; ++j) {
      if (!(mask & (1 << j))) continue;
      // Every element is owned by exactly one rank: a sum of it and zeros, exact.
      auto full = torch::zeros({param.numel()}, param.options().dtype(piece_dtype(opt, param)));
      const int k = piece_of[i];
      if (k >= 0 && local[k] && local[k]->tensors.count(kStateNames[j]))
        full.narrow(0, pieces[k].offset, pieces[k].numel).copy_(local[k]->tensors.at(kStateNames[j]).reshape({-1}));
      if (pg.size() > 1) comm::all_reduce(pg, full, comm::ReduceOp::kSum).wait();
      if (keep) entry[kStateNames[j]] = full.view(param.sizes());
    }
    if (keep) out.state[params[i].name] = std::move(entry);
  }
  if (keep) {
    std::unordered_map<const c10::TensorImpl*, std::string> names;
    if (opt.options().module())
      for (const auto& p : opt.options().module()->named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
    for (const auto& group : opt.param_groups()) {
      OptimStateDict::Group g;
      g.lr = group.options().get_lr();
      for (const auto& p : group.params()) {
        auto it = names.find(p.unsafeGetTensorImpl());
        TORCH_CHECK(it != names.end(), "fsdp::consolidate_state_dict: a parameter of the optimizer is not in "
                    "ZeroOptions::module");
        g.params.push_back(it->second);
      }
      out.param_groups.push_back(std::move(g));
    }
  }
  return out;
}

void load_consolidated_state_dict(optim::ZeroRedundancyOptimizer& opt, const OptimStateDict& full) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "load_consolidated_state_dict"});
  const auto params = opt.trainable_parameters();
  require_names(params, "load_consolidated_state_dict");
  torch::optim::Optimizer& inner = opt.inner();
  state::optimizer_kind(inner);  // refuses unsupported optimizers
  torch::NoGradGuard no_grad;
  for (const auto& pc : opt.local_pieces()) {
    const auto& tp = params[pc.param];
    auto it = full.state.find(tp.name);
    if (it == full.state.end()) {
      state::erase_param_state(inner, pc.tensor);
      continue;
    }
    state::ParamOptimState s;
    for (const auto& kv : it->second) {
      if (kv.first == "step") {
        s.step = kv.second.item<int64_t>();
        continue;
      }
      TORCH_CHECK(kv.second.numel() == tp.param.numel(), "fsdp::load_consolidated_state_dict (rank ",
                  opt.options().process_group().rank(), "): state '", kv.first, "' of parameter '", tp.name,
                  "' has ", kv.second.numel(), " elements, the parameter ", tp.param.numel(),
                  "; was the dict made for another model?");
      s.tensors[kv.first] =
          kv.second.reshape({-1}).narrow(0, pc.offset, pc.numel).to(pc.tensor.options()).clone();
    }
    state::set_param_state(inner, pc.tensor, std::move(s));
  }
}

}  // namespace fsdp
