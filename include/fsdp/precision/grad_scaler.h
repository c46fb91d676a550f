#pragma once
/// Dynamic loss scaling for reduced-precision training.
///
/// [Note: dynamic loss scaler]
/// DynamicGradScaler is the state machine of ColossalAI's DynamicGradScaler
/// (defaults of ShardedOptimizerV2, seed 001):
///  * a step whose gradients hold inf/nan is skipped; it adds one to the
///    overflow (hysteresis) counter and resets the growth counter; once the
///    overflow counter is >= `hysteresis` the scale is multiplied by
///    `backoff_factor` (not below `min_scale`) on this and every further
///    overflow until the next growth;
///  * a clean step adds one to the growth counter and leaves the overflow counter
///    alone; after `growth_interval` consecutive clean steps the scale is
///    multiplied by `growth_factor` (not above `max_scale`) and both counters
///    reset.
/// With hysteresis 2: inf, clean, inf backs off at the second inf.
///
/// ShardedGradScaler wraps it in torch.cuda.amp.GradScaler's API for sharded
/// training: scale(loss) -> backward -> unscale_(opt) [-> clip_grad_norm_] ->
/// step(opt) -> update(). The inf/nan flag is all-reduced (Max) over the group,
/// so every rank skips the same steps and the optimizer state stays in sync.

#include <cstdint>
#include <string>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include "fsdp/comm/process_group.h"

namespace fsdp::precision {

/// Options of DynamicGradScaler, checked by its constructor.
struct DynamicGradScalerOptions {
  TORCH_ARG(double, initial_scale) = 4294967296.0;  // 2^32
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 1000;
  TORCH_ARG(int64_t, hysteresis) = 2;
  TORCH_ARG(double, max_scale) = 4294967296.0;  // 2^32
};

/// Everything a checkpoint needs to resume the scaler.
struct GradScalerState {
  double scale = 1;
  int64_t growth_step = 0;      ///< consecutive clean steps since the last growth/overflow
  int64_t hysteresis_step = 0;  ///< overflows since the last growth
  /// {"scale": double[], "growth_step": long[], "hysteresis_step": long[]} (0-d tensors).
  c10::Dict<std::string, at::Tensor> to_dict() const;
  /// Inverse of to_dict; fails naming a missing key.
  static GradScalerState from_dict(const c10::Dict<std::string, at::Tensor>& d);
  bool operator==(const GradScalerState& o) const {
    return scale == o.scale && growth_step == o.growth_step && hysteresis_step == o.hysteresis_step;
  }
};

class DynamicGradScaler {
 public:
  explicit DynamicGradScaler(DynamicGradScalerOptions options = {});
  double scale() const { return state_.scale; }
  const DynamicGradScalerOptions& options() const { return options_; }
  /// One step of the state machine (see the note above).
  void update(bool overflow);
  const GradScalerState& state() const { return state_; }
  void load_state(const GradScalerState& s);

 private:
  DynamicGradScalerOptions options_;
  GradScalerState state_;
};

/// GradScaler-style driver of DynamicGradScaler over a process group.
class ShardedGradScaler {
 public:
  /// `group`: the ranks whose gradients make up one step (the FSDP group). An
  /// undefined group means a single process.
  explicit ShardedGradScaler(comm::ProcessGroup group = {}, DynamicGradScalerOptions options = {});

  /// loss * scale (in loss's dtype; a scale beyond its range is a user error).
  at::Tensor scale(const at::Tensor& loss) const;
  /// Divides the gradients of the optimizer's parameters by the scale, in place,
  /// and records whether any rank saw inf/nan (one all-reduce). Once per step;
  /// call it before clip_grad_norm_.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Runs optimizer.step() unless a rank found inf/nan (unscales first if the
  /// user did not). Returns true when the step ran.
  bool step(torch::optim::Optimizer& optimizer);
  /// Advances the scale and forgets this step's flags. Call after step().
  void update();

  double get_scale() const { return scaler_.scale(); }
  /// Whether the last unscale_ found inf/nan on any rank.
  bool found_inf() const { return found_inf_; }
  DynamicGradScaler& scaler() { return scaler_; }
  GradScalerState state() const { return scaler_.state(); }
  void load_state(const GradScalerState& s) { scaler_.load_state(s); }

 private:
  comm::ProcessGroup group_;
  DynamicGradScaler scaler_;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace fsdp::precision
