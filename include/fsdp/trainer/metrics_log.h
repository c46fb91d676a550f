#pragma once
/// A JSON-lines metrics file: one object per line, flushed per line, so a crashed run
/// keeps everything up to its last step. Written by rank 0 of fsdp::trainer::Trainer
/// (TrainerOptions::metrics_file) and of fsdp-train (--metrics); a hand-written loop
/// can use it too. Lines:
///   step:       {"step","epoch","loss","samples","lr","samples_per_s",
///                "memory":{"param_bytes","grad_bytes","optim_bytes","unsharded_peak_bytes","rss_bytes"},
///                and, on the first step line after a checkpoint finished,
///                "checkpoint":{"step","blocked_s","snapshot_s","cow_pages_copied","cow_fault_s",
///                              "cow_wait_s","background_s","bytes","gb_s"}}
///   validation: {"step","<validation_key>":{<the validation step's keys>},"samples"}
/// (StepMetrics and ValidationMetrics in callback.h say what each value is.)

#include <cstdint>
#include <fstream>
#include <string>

#include "fsdp/trainer/callback.h"

namespace fsdp::trainer {

class MetricsLog {
 public:
  /// Empty path: every write is a no-op. `append`: keep the lines already there (a
  /// resumed run's); else the file is truncated. `validation_key`: the key validation
  /// lines hold their values under (fsdp-train: "eval", its format since before the
  /// Trainer existed). Throws c10::Error if the file cannot be opened.
  MetricsLog(const std::string& path, bool append, std::string validation_key = "validation");
  bool enabled() const { return enabled_; }
  void write_step(const StepMetrics& m);
  void write_validation(const ValidationMetrics& m);

 private:
  bool enabled_ = false;
  std::string validation_key_;
  std::ofstream out_;
};

/// Resident set size of this process (/proc/self/statm), 0 if unreadable.
int64_t current_rss_bytes();
/// Peak resident set size of this process so far (getrusage ru_maxrss).
int64_t peak_rss_bytes();

}  // namespace fsdp::trainer
