#include "fsdp/state/summon_full_params.h"

#include <torch/torch.h>

#include "core/state_view.h"

namespace fsdp {

SummonFullParams::SummonFullParams(FullyShardedBase& model, SummonFullParamsOptions options)
    : SummonFullParams(model, options, "summon_full_params") {}

SummonFullParams::SummonFullParams(FullyShardedBase& model, SummonFullParamsOptions options, const char* what)
    : model_(&model), options_(options) {
  TORCH_CHECK(!(options.rank0_only() && options.writeback()), "fsdp: ", what, " with rank0_only=true "
              "cannot write back (the other ranks never see the full values); pass writeback(false)");
  core::detail::StateView view(model);
  view.require_idle(what);
  // Own full buffers in the shards' dtype (not the units' unsharded buffers,
  // which hold the low-precision compute copy under mixed precision), so what
  // the user sees and writes back is the full-precision value.
  const bool show = !options.rank0_only() || view.rank() == 0;
  for (size_t u = 0; u < view.num_units(); ++u) {
    if (!options.recurse() && !view.is_root(u)) continue;
    at::Tensor full = view.gather_full(u);
    if (!show) continue;  // took part in the gather only
    view.use_full_views(u, full);
    units_.push_back(static_cast<int>(u));
    buffers_.push_back(full);
  }
}

SummonFullParams::~SummonFullParams() noexcept(false) {
  core::detail::StateView view(*model_);
  for (size_t k = 0; k < units_.size(); ++k)
    view.use_shard_views(units_[k], options_.writeback() ? &buffers_[k] : nullptr);
  buffers_.clear();
}

void apply_with_full_params(FullyShardedBase& model, const std::function<void(torch::nn::Module&)>& fn) {
  SummonFullParams full(model, SummonFullParamsOptions().writeback(true), "apply_with_full_params");
  torch::NoGradGuard no_grad;
  fn(*model.module_ptr());
}

}  // namespace fsdp
