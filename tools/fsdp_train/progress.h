#pragma once
/// Rank 0's progress report on stderr. On a terminal: one line redrawn with '\r' (a bar).
/// Otherwise (a pipe, a log file, fsdp-run's rank prefixer): one plain line every
/// `log_every` steps, so logs stay greppable. Torch-free.

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace fsdp::train {

class Progress {
 public:
  Progress(int64_t total_steps, int64_t log_every, bool enabled);
  /// After step `step` (1-based) with the global mean loss of that step;
  /// `samples_per_s` is the throughput since the previous report.
  void report(int64_t step, double loss, double samples_per_s);
  /// A line of its own (evaluation results), keeping the bar intact.
  void note(const char* line);
  /// Ends the bar's line.
  void finish();

 private:
  int64_t total_, log_every_;
  bool enabled_, tty_;
  bool bar_open_ = false;
  std::chrono::steady_clock::time_point start_;
};

/// "1h02m", "3m05s", "12s".
void format_duration(double seconds, char* out, size_t size);

}  // namespace fsdp::train
