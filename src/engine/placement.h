#pragma once
// Placement "auto": which pieces of offloaded state move back to the device under a
// gpu_margin_mem_ratio, for FSDP (Options::gpu_margin_mem_ratio, a unit's shard) and ZeRO
// (ZeroOptions::gpu_margin_mem_ratio, a bucket's chunk of the partition) alike.
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
#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "memory/device_memory.h"

namespace torch::optim {
class Optimizer;
}

namespace fsdp::engine {

/// ratio x (capacity - peak), never negative.
int64_t margin_budget(const memory::DeviceMemory& m, double ratio);

/// 1 for each piece placed on the device, in the given order while the budget lasts.
std::vector<uint8_t> device_pieces(const std::vector<int64_t>& piece_bytes, int64_t budget);

/// One piece of offloaded state placement may move: its tensor (a unit's shard, a bucket's
/// chunk of masters) and the parameters whose optimizer state goes with it.
struct OffloadedPiece {
  int64_t tensor_bytes = 0;
  std::vector<at::Tensor> state_params;  // keys of their state in the optimizer
};

/// The one placement function ([Note: auto placement]): of `pieces` (in reduce order), those
/// whose bytes (the tensor's, and its parameters' optimizer state as `optimizer` holds it now)
/// fit in `ratio` x `device`'s margin get their state moved to `device` and `move(i)` called,
/// which moves the piece's tensor. Returns 1 for each piece placed.
std::vector<uint8_t> place_on_device(const std::vector<OffloadedPiece>& pieces,
                                     const torch::optim::Optimizer& optimizer, const c10::Device& device,
                                     double ratio, const std::function<void(size_t)>& move);

}  // namespace fsdp::engine
