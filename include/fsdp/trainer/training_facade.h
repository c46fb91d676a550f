#pragma once
/// LowLevelZero's training-loop calls, one loop for both families: a
/// ZeroRedundancyOptimizer over an unwrapped model, or a FullyShardedDataParallel model
/// with any optimizer over its parameters (ColossalAI pairs ShardedModelV2 with
/// ShardedOptimizerV2 behind the same calls).
///
///     fsdp::trainer::TrainingFacade zero_train(zero_opt);              // ZeRO-1/2
///     fsdp::trainer::TrainingFacade train(*fsdp_model, adam,           // FSDP
///         fsdp::trainer::FacadeOptions().dynamic_loss_scale(
///             fsdp::optim::ZeroOptions::low_level_zero_scaler()));
///     for (...) {                                      // the same loop for either
///       train.zero_grad();
///       train.backward(loss_fn(model->forward(x)));   // loss * scale / accumulation steps
///       if (!train.step()) continue;                   // skipped: inf/nan on some rank
///     }
///
/// step(): unscale, one cross-rank overflow check, skip on inf/nan anywhere (gradients
/// discarded, the scaler backs off per its hysteresis), clip the global norm, step.
/// Under ZeRO every call is the optimizer's own (its ZeroOptions hold the scaler, the
/// clipping and the accumulation steps); under FSDP FacadeOptions holds them, the
/// overflow check is ShardedGradScaler's and clipping FullyShardedBase::clip_grad_norm_.

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/precision/grad_scaler.h"

namespace fsdp::trainer {

/// The FSDP side's options, named as ZeroOptions names them; checked by the constructor.
struct FacadeOptions {
  /// Unset: a static scale of 1 (bf16 and fp32 need no scaling).
  TORCH_ARG(c10::optional<precision::DynamicGradScalerOptions>, dynamic_loss_scale) = c10::nullopt;
  /// Global L2 norm above which step() scales the gradients down. 0: off.
  TORCH_ARG(double, clip_grad_norm) = 0.0;
  /// backward(loss) divides the loss by this. >= 1.
  TORCH_ARG(int64_t, gradient_accumulation_steps) = 1;
};

class TrainingFacade {
 public:
  /// Drives `opt` (which must outlive this): every call is opt's.
  explicit TrainingFacade(optim::ZeroRedundancyOptimizer& opt);
  /// Drives an FSDP model and an optimizer over its parameters (both must outlive this).
  /// Under fsdp::Options::optimizer_in_backward it registers `opt` with the model (step()
  /// then only finishes the iteration) and refuses dynamic_loss_scale and clip_grad_norm.
  TrainingFacade(FullyShardedBase& model, torch::optim::Optimizer& opt, FacadeOptions options = {});
  ~TrainingFacade();

  /// (loss * loss_scale() / gradient_accumulation_steps).backward().
  void backward(const at::Tensor& loss);
  /// Collective. Returns whether the parameters were updated.
  bool step();
  /// Drops the gradients (set_to_none) or zeroes them.
  void zero_grad(bool set_to_none = true);
  /// The scale backward() applies next (1 without a dynamic scaler).
  double loss_scale() const;
  bool last_step_applied() const;
  /// Global gradient norm before clipping found by the last step() (-1: not computed).
  double last_grad_norm() const;

 private:
  optim::ZeroRedundancyOptimizer* zero_ = nullptr;
  FullyShardedBase* model_ = nullptr;
  torch::optim::Optimizer* opt_ = nullptr;
  FacadeOptions options_;
  std::unique_ptr<precision::ShardedGradScaler> scaler_;
  bool last_applied_ = true;
  double last_norm_ = -1;
};

}  // namespace fsdp::trainer

// The earlier spellings in fsdp::optim, kept deprecated (CHANGELOG.md, "Renamed").
namespace fsdp::optim {
using FacadeOptions [[deprecated("use fsdp::trainer::FacadeOptions")]] = fsdp::trainer::FacadeOptions;
using TrainingFacade [[deprecated("use fsdp::trainer::TrainingFacade")]] = fsdp::trainer::TrainingFacade;
}  // namespace fsdp::optim
