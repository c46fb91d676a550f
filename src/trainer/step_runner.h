#pragma once
// Internal to src/trainer: one optimizer step of the loop. The step's global batch is
// cut into k micro-batches and each into contiguous rank parts ([Note: global
// batches], steps 3-4); each part runs the user's training step and backward (FSDP
// skips the reduction of all but the last micro-batch: no_sync); then clipping, the
// optimizer, the LR scheduler and on_optimizer_step.
#include <cstdint>
#include <utility>
#include <vector>

#include "fsdp/trainer/callback.h"
#include "loop_context.h"
#include "step_plan.h"

namespace fsdp::trainer::detail {

/// A step that ran: its metrics but the loss, and this rank's share of the loss, whose
/// sum over ranks divided by `loss_divisor` is the step's loss ([Note: step loss]).
struct RanStep {
  StepMetrics metrics;
  double local_loss = 0;
  double loss_divisor = 1;
};

class StepRunner {
 public:
  /// Asks the callbacks once whether the steps' metrics need a memory sample.
  StepRunner(const LoopContext& ctx, StepPlan& plan);
  /// Trains step `step` (0-based; metrics.step is step + 1).
  RanStep run(int64_t step);

 private:
  /// This rank's sums over its samples, for the step's loss.
  struct LossSums {
    double loss = 0;   // of the per-sample loss
    double means = 0;  // of its micro-batches' mean losses
  };
  void clear_gradients();
  /// Which micro-batch of which step a part belongs to (for error messages).
  struct PartOf {
    int64_t step;
    size_t micro, micros;
  };
  LossSums forward_backward(const std::vector<int64_t>& batch, int64_t step);
  void train_part(const std::vector<int64_t>& batch, std::pair<int64_t, int64_t> micro, PartOf where, LossSums& sums);
  void optimizer_step(int64_t step);
  /// This rank's share of the step's loss from its sums over an m-sample batch.
  void share_of_loss(const LossSums& sums, int64_t m, RanStep& ran) const;

  const LoopContext& ctx_;
  StepPlan& plan_;
  bool want_memory_ = false;
};

}  // namespace fsdp::trainer::detail
