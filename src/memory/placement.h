#pragma once
// Which pieces of offloaded state move back to the device under a gpu_margin_mem_ratio
// (ZeroOptions and FSDP's Options). Arithmetic only.
//
// [Note: auto placement]
// ColossalAI's "auto" placement: after a warm-up step, the device memory the step left unused at
// its peak is the margin; `gpu_margin_mem_ratio` of it may hold optimizer state, which is then
// stepped on the device (HybridAdam: CPUAdam's op-by-op path there, its fused kernel on the
// host). The piece moved is a ZeroRedundancyOptimizer bucket's chunk of the partition, or an
// FSDP unit's shard: its fp32 masters and their optimizer state, whose bytes are known after the
// warm-up step (the state exists then). Pieces are taken in the order backward reduces them
// (ZeRO's flat order; FSDP's reduce order) while they fit; one that does not fit is skipped and
// later, smaller ones may still fit. Decided once: a placement that moved with every step's
// peak would copy state back and forth. The budget is rounded down to whole pieces, so the
// device never holds more than ratio x margin of state.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "memory/device_memory.h"

namespace fsdp::memory {

/// ratio x (capacity - peak), never negative.
inline int64_t margin_budget(const memory::DeviceMemory& m, double ratio) {
  const int64_t margin = std::max<int64_t>(0, m.capacity - m.peak_allocated);
  return static_cast<int64_t>(static_cast<double>(margin) * ratio);
}

/// 1 for each piece placed on the device, in the given order while the budget lasts.
inline std::vector<uint8_t> device_pieces(const std::vector<int64_t>& piece_bytes, int64_t budget) {
  std::vector<uint8_t> on_device(piece_bytes.size(), 0);
  for (size_t b = 0; b < piece_bytes.size(); ++b) {
    if (piece_bytes[b] > budget) continue;
    on_device[b] = 1;
    budget -= piece_bytes[b];
  }
  return on_device;
}

}  // namespace fsdp::memory
