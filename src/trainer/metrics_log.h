#pragma once
/// TrainerOptions::metrics_file: rank 0 writes one JSON object per line, flushed per
/// line, so a crashed run keeps everything up to its last step (the format is in
/// include/fsdp/trainer/trainer.h). The idea of fsdp-train's tools/fsdp_train/metrics.h,
/// with the Trainer's keys; fsdp-train keeps its own until it is ported.

#include <cstdint>
#include <fstream>
#include <string>

#include "fsdp/trainer/callback.h"

namespace fsdp::trainer::detail {

class MetricsLog {
 public:
  /// Empty path: every write is a no-op. `append`: keep the lines of the run being
  /// resumed. Throws c10::Error if the file cannot be opened.
  MetricsLog(const std::string& path, bool append);
  void write_step(const StepMetrics& m);
  void write_validation(const ValidationMetrics& m);

 private:
  bool enabled_ = false;
  std::ofstream out_;
};

/// Resident set size of this process (/proc/self/statm), 0 if unreadable.
int64_t current_rss_bytes();
/// Peak resident set size of this process so far (getrusage ru_maxrss).
int64_t peak_rss_bytes();

}  // namespace fsdp::trainer::detail
