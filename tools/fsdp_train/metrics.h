#pragma once
/// `--metrics FILE`: rank 0 appends one JSON object per line, flushed per line so a
/// crashed or interrupted run keeps everything up to its last step.
///   step: {"step","loss","lr","samples_per_s","memory":{"param_bytes","grad_bytes",
///          "optim_bytes","unsharded_peak_bytes","rss_bytes"}}
///   eval: {"step","eval":{"loss","accuracy"}}   (accuracy: fraction of the test set; gpt:
///         of the validation bytes whose next byte the argmax predicts)
/// samples_per_s counts the task's samples: images, or windows of --context+1 bytes (gpt).

#include <cstdint>
#include <fstream>
#include <string>

namespace fsdp::train {

struct MemorySample {
  int64_t param_bytes = 0, grad_bytes = 0, optim_bytes = 0, unsharded_peak_bytes = 0, rss_bytes = 0;
};

class MetricsWriter {
 public:
  /// Empty path: every write is a no-op. Throws std::runtime_error if the file cannot be created.
  explicit MetricsWriter(const std::string& path);
  bool enabled() const { return enabled_; }
  void write_step(int64_t step, double loss, double lr, double samples_per_s, const MemorySample& m);
  void write_eval(int64_t step, double loss, double accuracy);

 private:
  bool enabled_ = false;
  std::ofstream out_;
};

/// Resident set size of this process (/proc/self/statm), 0 if unreadable.
int64_t current_rss_bytes();
/// Peak resident set size of this process so far (getrusage ru_maxrss).
int64_t peak_rss_bytes();

}  // namespace fsdp::train
