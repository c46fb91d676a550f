#pragma once
/// Peak resident memory of fsdp-train's two phases, construction (building the model and
/// wrapping it) and training, each above the rank's resident set before the model was built
/// (so the process, libtorch and the dataset are not counted). The kernel's peak (VmHWM)
/// is reset at the start of each phase by writing 5 to /proc/self/clear_refs (Linux >= 4.0);
/// where that fails the peaks are the process's peak so far and exact() says so.

#include <cstdint>

namespace fsdp::train {

class PhaseMemory {
 public:
  /// Records the resident set now and starts the construction phase.
  PhaseMemory();
  /// Ends construction (its peak is kept) and starts the training phase.
  void end_construction();
  /// Peak resident bytes above the start, during construction / training so far.
  int64_t construction_peak() const { return construction_peak_; }
  int64_t training_peak() const;
  /// The process's peak resident bytes over both phases (absolute; getrusage's
  /// ru_maxrss follows the reset, so it no longer gives this).
  int64_t run_peak() const;
  bool exact() const { return exact_; }

 private:
  int64_t base_ = 0;
  int64_t construction_peak_ = 0;
  bool exact_ = true;
};

}  // namespace fsdp::train
