#include "fsdp/precision/grad_scaler.h"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"

namespace fsdp::precision {

c10::Dict<std::string, at::Tensor> GradScalerState::to_dict() const {
  c10::Dict<std::string, at::Tensor> d;
  d.insert("scale", torch::tensor(scale, torch::kDouble));
  d.insert("growth_step", torch::tensor(growth_step, torch::kLong));
  d.insert("hysteresis_step", torch::tensor(hysteresis_step, torch::kLong));
  return d;
}

GradScalerState GradScalerState::from_dict(const c10::Dict<std::string, at::Tensor>& d) {
  auto get = [&](const char* key) {
    TORCH_CHECK(d.contains(key), "fsdp: grad scaler state has no '", key,
                "' entry; was it saved by GradScalerState::to_dict?");
    return d.at(key);
  };
  GradScalerState s;
  s.scale = get("scale").item<double>();
  s.growth_step = get("growth_step").item<int64_t>();
  s.hysteresis_step = get("hysteresis_step").item<int64_t>();
  return s;
}

DynamicGradScaler::DynamicGradScaler(DynamicGradScalerOptions o) : options_(o) {
  TORCH_CHECK(o.min_scale() > 0, "fsdp: DynamicGradScaler min_scale must be > 0, got ", o.min_scale());
  TORCH_CHECK(o.max_scale() >= o.min_scale(), "fsdp: DynamicGradScaler max_scale (", o.max_scale(),
              ") must be >= min_scale (", o.min_scale(), ")");
  TORCH_CHECK(o.initial_scale() >= o.min_scale() && o.initial_scale() <= o.max_scale(),
              "fsdp: DynamicGradScaler initial_scale ", o.initial_scale(), " must lie in [min_scale ",
              o.min_scale(), ", max_scale ", o.max_scale(), "]");
  TORCH_CHECK(o.growth_factor() >= 1, "fsdp: DynamicGradScaler growth_factor must be >= 1, got ",
              o.growth_factor());
  TORCH_CHECK(o.backoff_factor() > 0 && o.backoff_factor() <= 1,
              "fsdp: DynamicGradScaler backoff_factor must lie in (0, 1], got ", o.backoff_factor());
  TORCH_CHECK(o.growth_interval() >= 1, "fsdp: DynamicGradScaler growth_interval must be >= 1, got ",
              o.growth_interval());
  TORCH_CHECK(o.hysteresis() >= 1, "fsdp: DynamicGradScaler hysteresis must be >= 1, got ",
              o.hysteresis());
  state_.scale = o.initial_scale();
}

void DynamicGradScaler::update(bool overflow) {
  if (overflow) {
    ++state_.hysteresis_step;
    state_.growth_step = 0;
    if (state_.hysteresis_step >= options_.hysteresis())
      state_.scale = std::max(state_.scale * options_.backoff_factor(), options_.min_scale());
  } else {
    ++state_.growth_step;
    if (state_.growth_step >= options_.growth_interval()) {
      state_.growth_step = 0;
      state_.hysteresis_step = 0;
      state_.scale = std::min(state_.scale * options_.growth_factor(), options_.max_scale());
    }
  }
}

void DynamicGradScaler::load_state(const GradScalerState& s) {
  TORCH_CHECK(s.scale > 0 && std::isfinite(s.scale), "fsdp: grad scaler state has scale ", s.scale,
              "; expected a finite positive number");
  TORCH_CHECK(s.growth_step >= 0 && s.hysteresis_step >= 0,
              "fsdp: grad scaler state has negative counters");
  state_ = s;
}

ShardedGradScaler::ShardedGradScaler(comm::ProcessGroup group, DynamicGradScalerOptions options)
    : group_(std::move(group)), scaler_(options) {}

at::Tensor ShardedGradScaler::scale(const at::Tensor& loss) const { return loss * scaler_.scale(); }

void ShardedGradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(!unscaled_, "fsdp: ShardedGradScaler::unscale_ called twice in one step; call update() "
              "after step()");
  torch::NoGradGuard no_grad;
  const double inv = 1.0 / scaler_.scale();
  // Accumulated in fp32 on this rank, then one all-reduce for every rank.
  auto flag = torch::zeros({1}, torch::kFloat);
  for (auto& g : optimizer.param_groups())
    for (auto& p : g.params()) {
      auto& grad = p.mutable_grad();
      if (!grad.defined() || grad.numel() == 0) continue;
      grad.mul_(inv);
      // A single reduction catches inf and nan (nan propagates, inf stays inf).
      if (!std::isfinite(grad.sum(at::kDouble).item<double>())) flag.fill_(1);
    }
  if (group_.defined() && group_.size() > 1) comm::all_reduce(group_, flag, comm::ReduceOp::kMax, {comm::Phase::kStep, "grad_scaler"}).wait();
  found_inf_ = flag.item<float>() != 0;
  unscaled_ = true;
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!unscaled_) unscale_(optimizer);
  if (found_inf_) return false;
  optimizer.step();
  return true;
}

void ShardedGradScaler::update() {
  TORCH_CHECK(unscaled_, "fsdp: ShardedGradScaler::update() before unscale_/step of this step");
  scaler_.update(found_inf_);
  unscaled_ = false;
}

}  // namespace fsdp::precision
