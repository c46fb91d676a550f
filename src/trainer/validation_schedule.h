#pragma once
// Internal to src/trainer: the validations of a run, every val_check_interval steps
// and once after the last step. A validation is the user's validation_loop, or the
// validation step over the validation set (global batches of val_batch_size, each cut
// into contiguous rank parts; per-key means weighted by the parts' counts). It runs
// with the module in eval() and under NoGradGuard, and its time is not training time.
#include <cstdint>

#include "fsdp/trainer/fit_result.h"
#include "fsdp/trainer/metrics_log.h"
#include "fsdp/trainer/progress.h"
#include "loop_context.h"

namespace fsdp::trainer::detail {

class ValidationSchedule {
 public:
  ValidationSchedule(const LoopContext& ctx, MetricsLog& log, Progress& progress, FitResult& result);

  /// Whether a validation is due after `step` steps (val_check_interval).
  bool due(int64_t step) const;
  /// Validates the model after `step` steps (collective; nothing without validation):
  /// metrics file, progress note, on_validation_end, FitResult::validation.
  void run(int64_t step);
  /// After the last step, `last_step`: validates unless run() just did.
  void finish(int64_t last_step);
  /// Seconds spent validating so far.
  double seconds() const { return seconds_; }

 private:
  ValidationMetrics validate(int64_t step);
  ValidationMetrics mean_over_validation_set();
  void announce(const ValidationMetrics& vm);

  const LoopContext& ctx_;
  MetricsLog& log_;
  Progress& progress_;
  FitResult& result_;
  int64_t last_validated_ = -1;
  double seconds_ = 0;
};

}  // namespace fsdp::trainer::detail
