#pragma once
// Internal to src/trainer: what happens to a step once its global loss is known: the
// FitResult's losses, the metrics file, on_step_end and the progress line. The loss
// is all-reduced in the background ([Note: overlapped step loss] in
// step_loss_reduction.h), so a step is reported when the reduction is taken back.
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "fsdp/trainer/fit_result.h"
#include "fsdp/trainer/metrics_log.h"
#include "fsdp/trainer/progress.h"
#include "fsdp/trainer/step_loss_reduction.h"
#include "loop_context.h"
#include "step_runner.h"

namespace fsdp::trainer::detail {

class StepReporter {
 public:
  StepReporter(const LoopContext& ctx, MetricsLog& log, Progress& progress, int64_t total_steps, FitResult& result);

  /// Starts the reduction of the step's loss (collective).
  void add(const RanStep& ran);
  /// Reports the oldest steps until at most `may_stay` are still in flight.
  void report_until(size_t may_stay);
  /// The next progress line's rate counts from now (after a pause: validation).
  void restart_interval();
  /// The last step reported, or one at the run's last step when none was (a resumed run
  /// with nothing left to do): what on_train_end is told.
  StepMetrics last() const;

 private:
  void report(StepMetrics sm);

  const LoopContext& ctx_;
  MetricsLog& log_;
  Progress& progress_;
  const int64_t total_steps_;
  FitResult& result_;
  StepLossReduction losses_;
  StepMetrics last_;
  size_t checkpoints_reported_ = 0;  // of result_.checkpoints, on a step's metrics
  int64_t interval_samples_ = 0;
  LoopClock::time_point interval_start_ = LoopClock::now();
};

}  // namespace fsdp::trainer::detail
