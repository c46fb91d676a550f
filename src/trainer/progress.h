#pragma once
/// Rank 0's progress report on stderr (a copy of fsdp-train's tools/fsdp_train/progress.h,
/// kept apart until fsdp-train is ported onto the Trainer). On a terminal: one line
/// redrawn with '\r' (a bar). Otherwise: one plain line per report, so logs stay greppable.

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace fsdp::trainer::detail {

class Progress {
 public:
  Progress(int64_t total_steps, bool enabled);
  /// After step `step` (1-based) with the global mean loss of that step;
  /// `samples_per_s` is the throughput since the previous report.
  void report(int64_t step, double loss, double samples_per_s);
  /// A line of its own (validation results), keeping the bar intact.
  void note(const char* line);
  /// Ends the bar's line.
  void finish();

 private:
  int64_t total_;
  bool enabled_, tty_;
  bool bar_open_ = false;
  int64_t first_step_ = -1;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace fsdp::trainer::detail
