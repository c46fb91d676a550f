#pragma once
/// A training run's progress report on stderr, for the one rank that reports (rank 0):
/// what fsdp::trainer::Trainer prints with TrainerOptions::progress, and fsdp-train
/// always. On a terminal: one line redrawn with '\r' (a bar). Otherwise (a pipe, a log
/// file, fsdp-run's rank prefixer): one plain line per report,
///   step S/T  loss L  R samples/s  ETA 3m05s
/// so logs stay greppable. Torch-free; a hand-written loop can use it as it is.

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace fsdp::trainer {

class Progress {
 public:
  /// Steps `first_step`+1 .. `total_steps` are to run (first_step > 0: a resumed run).
  /// `enabled` false (the other ranks): every call is a no-op.
  Progress(int64_t total_steps, bool enabled, int64_t first_step = 0);
  /// After step `step` (1-based) with the global mean loss of that step;
  /// `samples_per_s` is the throughput since the previous report. The ETA is the mean
  /// time of the steps this object has seen (since construction) times the steps left.
  void report(int64_t step, double loss, double samples_per_s);
  /// A line of its own (validation results), keeping the bar intact.
  void note(const char* line);
  /// Ends the bar's line.
  void finish();

 private:
  int64_t total_;
  bool enabled_, tty_;
  bool bar_open_ = false;
  int64_t first_step_;
  std::chrono::steady_clock::time_point start_;
};

/// "1h02m", "3m05s", "12s".
void format_duration(double seconds, char* out, size_t size);

}  // namespace fsdp::trainer
