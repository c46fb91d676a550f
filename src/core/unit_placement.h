#pragma once
// FSDP's placement "auto" (Options::gpu_margin_mem_ratio): which offloaded units move back to
// the compute device after the warm-up iteration, and the move ([Note: auto placement] in
// src/engine/placement.h). A placed unit is an ordinary unit on the device from then on: its
// shard is gathered and stepped there (BackwardOptimizer steps it on the backward thread).

#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fsdp::core::detail {

class Unit;

/// Of `reduce_order` (the units in the order backward reduced them), the offloaded ones with
/// trainable parameters whose shard and optimizer state (its bytes as `optimizer` holds it
/// now) fit in `ratio` x the compute device's margin move there, state and all. Returns them.
std::vector<Unit*> place_units_on_device(const std::vector<Unit*>& reduce_order,
                                         const torch::optim::Optimizer& optimizer, double ratio);

}  // namespace fsdp::core::detail
