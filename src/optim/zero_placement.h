#pragma once
// Which buckets of a ZeroRedundancyOptimizer partition keep their masters and optimizer state on
// the device under ZeroOptions::gpu_margin_mem_ratio. Arithmetic only.
//
// [Note: auto placement]
// ColossalAI's "auto" placement: after a warm-up step, the device memory the step left unused at
// its peak is the margin; `gpu_margin_mem_ratio` of it may hold optimizer state, which is then
// stepped on the device (HybridAdam: CPUAdam's op-by-op path there, its fused kernel on the
// host). Here the unit moved is a bucket's chunk of the partition: its fp32 masters and their
// optimizer state, whose bytes are known after the warm-up step (the state exists then). Buckets
// are taken in flat order (the order backward reduces them) while they fit; a bucket that does not
// fit is skipped and later, smaller ones may still fit. Decided once: a placement that moved
// with every step's peak would copy state back and forth. The budget is rounded down to whole
// buckets, so the device never holds more than ratio x margin of state.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "memory/device_memory.h"

namespace fsdp::optim::detail {

/// ratio x (capacity - peak), never negative.
inline int64_t margin_budget(const memory::DeviceMemory& m, double ratio) {
  const int64_t margin = std::max<int64_t>(0, m.capacity - m.peak_allocated);
  return static_cast<int64_t>(static_cast<double>(margin) * ratio);
}

/// 1 for each bucket placed on the device, in flat order while the budget lasts.
inline std::vector<uint8_t> device_buckets(const std::vector<int64_t>& bucket_bytes, int64_t budget) {
  std::vector<uint8_t> on_device(bucket_bytes.size(), 0);
  for (size_t b = 0; b < bucket_bytes.size(); ++b) {
    if (bucket_bytes[b] > budget) continue;
    on_device[b] = 1;
    budget -= bucket_bytes[b];
  }
  return on_device;
}

}  // namespace fsdp::optim::detail
