// TrainingFacade: LowLevelZero's loop calls over a ZeroRedundancyOptimizer (delegation)
// or an FSDP model and its optimizer (ShardedGradScaler + clip_grad_norm_).
#include "fsdp/trainer/training_facade.h"

#include <cmath>
#include <limits>

#include <torch/torch.h>

namespace fsdp::trainer {

TrainingFacade::TrainingFacade(optim::ZeroRedundancyOptimizer& opt) : zero_(&opt) {}

TrainingFacade::TrainingFacade(FullyShardedBase& model, torch::optim::Optimizer& opt, FacadeOptions options)
    : model_(&model), opt_(&opt), options_(std::move(options)) {
  TORCH_CHECK(std::isfinite(options_.clip_grad_norm()) && options_.clip_grad_norm() >= 0,
              "TrainingFacade: clip_grad_norm must be a finite value >= 0 (0 turns clipping off), got ",
              options_.clip_grad_norm());
  TORCH_CHECK(options_.gradient_accumulation_steps() >= 1,
              "TrainingFacade: gradient_accumulation_steps must be >= 1, got ", options_.gradient_accumulation_steps());
  if (model.options().optimizer_in_backward()) {
    // Both read every gradient before any step; inside backward each unit is stepped first.
    TORCH_CHECK(!options_.dynamic_loss_scale() && options_.clip_grad_norm() == 0, "TrainingFacade (rank ",
                model.process_group().rank(), "): FacadeOptions ",
                options_.dynamic_loss_scale() ? "dynamic_loss_scale (its inf/nan check)" : "clip_grad_norm",
                " needs every gradient before the step, but fsdp::Options::optimizer_in_backward steps each unit "
                "inside backward; drop it or turn optimizer_in_backward off");
    model.register_optimizer_in_backward(opt);
  }
  if (options_.dynamic_loss_scale())
    scaler_ = std::make_unique<precision::ShardedGradScaler>(model.process_group(), *options_.dynamic_loss_scale());
}

TrainingFacade::~TrainingFacade() = default;

void TrainingFacade::backward(const at::Tensor& loss) {
  if (zero_) return zero_->backward(loss);
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "TrainingFacade::backward (rank ", model_->process_group().rank(),
              "): the loss must be a tensor of one element, got ", loss.defined() ? loss.sizes() : at::IntArrayRef{});
  const double factor = loss_scale() / static_cast<double>(options_.gradient_accumulation_steps());
  if (factor == 1.0) loss.backward();
  else (loss * factor).backward();
}

bool TrainingFacade::step() {
  if (zero_) {
    zero_->step();
    return zero_->last_step_applied();
  }
  last_norm_ = -1;
  if (scaler_) {
    scaler_->unscale_(*opt_);  // one all-reduce: did any rank see inf/nan?
    if (scaler_->found_inf()) {
      // LowLevelZero: the step is skipped and its gradients discarded, on every rank.
      last_norm_ = std::numeric_limits<double>::infinity();
      zero_grad(/*set_to_none=*/true);
      scaler_->update();
      last_applied_ = false;
      return false;
    }
  }
  if (options_.clip_grad_norm() > 0) last_norm_ = model_->clip_grad_norm_(options_.clip_grad_norm()).item<double>();
  opt_->step();
  if (scaler_) scaler_->update();
  last_applied_ = true;
  return true;
}

void TrainingFacade::zero_grad(bool set_to_none) {
  if (zero_) return zero_->zero_grad(set_to_none);
  opt_->zero_grad(set_to_none);
}

double TrainingFacade::loss_scale() const {
  if (zero_) return zero_->loss_scale();
  return scaler_ ? scaler_->get_scale() : 1.0;
}

bool TrainingFacade::last_step_applied() const { return zero_ ? zero_->last_step_applied() : last_applied_; }

double TrainingFacade::last_grad_norm() const { return zero_ ? zero_->last_grad_norm() : last_norm_; }

}  // namespace fsdp::trainer
