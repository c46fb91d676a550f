#include "phase_memory.h"

#include <algorithm>
#include <fstream>
#include <string>

#include "fsdp/trainer/metrics_log.h"

namespace fsdp::train {

namespace {

// The kernel's peak resident set (VmHWM) of this process, bytes.
int64_t peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  int64_t kib = 0;
  while (status >> key) {
    if (key == "VmHWM:") {
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 20, '\n');
  }
  return fsdp::trainer::peak_rss_bytes();
}

// VmHWM := VmRSS; false if the kernel does not allow it.
bool reset_peak_resident() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

}  // namespace

PhaseMemory::PhaseMemory() : base_(fsdp::trainer::current_rss_bytes()) { exact_ = reset_peak_resident(); }

void PhaseMemory::end_construction() {
  construction_peak_ = std::max<int64_t>(0, peak_resident_bytes() - base_);
  exact_ = reset_peak_resident() && exact_;
}

int64_t PhaseMemory::run_peak() const { return std::max(base_ + construction_peak_, peak_resident_bytes()); }

int64_t PhaseMemory::training_peak() const { return std::max<int64_t>(0, peak_resident_bytes() - base_); }

}  // namespace fsdp::train
