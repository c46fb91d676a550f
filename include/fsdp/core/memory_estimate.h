#pragma once
/// Model-state bytes per rank by strategy: the ZeRO paper's accounting (§5). Ψ
/// parameters, N ranks (G: shard group size under HYBRID_SHARD), `param_bytes`
/// bytes per parameter and per gradient element (4 for fp32), `optim_bytes` of
/// optimizer state per parameter (8 for Adam's two fp32 moments):
///   NO_SHARD       (2p + o)Ψ              fp32 Adam: 16Ψ
///   SHARD_GRAD_OP  pΨ + (p + o)Ψ/N        fp32 Adam: 4Ψ + 12Ψ/N (parameters replicated, ZeRO-2)
///   FULL_SHARD     (2p + o)Ψ/N            fp32 Adam: 16Ψ/N
///   HYBRID_SHARD   (2p + o)Ψ/G
/// Activations, transient unsharded buffers and flat-buffer padding are not included.
/// (This library's SHARD_GRAD_OP reshards after backward, so between steps it actually
/// holds FULL_SHARD's bytes; the ZeRO-2 figure is its peak during forward/backward.)

#include <cstdint>
#include <vector>

#include "fsdp/core/options.h"

namespace fsdp {

struct ModelStateEstimate {
  double param_bytes = 0;
  double grad_bytes = 0;
  double optim_bytes = 0;
  double total() const { return param_bytes + grad_bytes + optim_bytes; }
};

ModelStateEstimate estimate_model_state(int64_t num_params, int world_size, ShardingStrategy strategy,
                                        int shard_group_size = 0, int64_t param_bytes = 4,
                                        int64_t optim_bytes = 8);

/// The same accounting for fsdp::optim::ZeroRedundancyOptimizer over an unwrapped model
/// (parameters replicated), `stage` 1 or 2; p = param_bytes (2 with bf16 parameters,
/// ZeroOptions::param_dtype, whose fp32 masters and fp32 reduced gradients then join
/// each rank's partition, 4Ψ/N each), o = optim_bytes:
///   stage 1  fp32: 4Ψ params + 4Ψ grads + oΨ/N      bf16: (2Ψ + 4Ψ/N) + (2Ψ + 4Ψ/N) + oΨ/N
///   stage 2  fp32: 4Ψ params + 4Ψ/N grads + oΨ/N    bf16: (2Ψ + 4Ψ/N) + 4Ψ/N + oΨ/N
/// With Adam: fp32 8Ψ + 8Ψ/N and 4Ψ + 12Ψ/N; bf16 4Ψ + 16Ψ/N and 2Ψ + 16Ψ/N (what
/// tests/test_zero_optimizer.cpp measures within 5%). Masters are counted as parameters,
/// as ZeroRedundancyOptimizer::get_memory_usage does.
ModelStateEstimate estimate_zero_model_state(int64_t num_params, int world_size, int stage, int64_t param_bytes = 4,
                                             int64_t optim_bytes = 8);

/// Peak parameter bytes one rank holds while a model is built and wrapped by
/// FullyShardedDataParallel (allocator-counted: what tests/test_sharded_init.cpp
/// measures). `unit_numels`: the parameters of each unit below the root, in
/// construction order; `outside_numel`: the parameters left to the root unit;
/// chunk(n) = ceil(n / N) (padded_numel / N; N = world, or the shard group under
/// HYBRID_SHARD; chunk(n) = n under NO_SHARD); p = param_bytes:
///   eager    p (Ψ + max_k chunk(n_k)): the whole model, then each unit's shard
///            is copied out before its full values are freed.
///   sharded  (ShardedInitContext) p max(max_k [Σ_{j<=k} chunk(n_j) + n_k] + outside,
///            Σ_j chunk(n_j) + outside + chunk(outside)): unit k is built next to
///            the shards before it and copied into its own; then FSDP flattens
///            the root unit. With equal units: shards + largest unit +
///            parameters outside units (the construction bound, shards + largest unit
///            x (1 + 1/N) + outside, counts the last unit's shard twice).
///   after    p (Σ_j chunk(n_j) + chunk(outside)): the shards, either way.
/// Gradients, optimizer state and activations come later (estimate_model_state).
struct ConstructionEstimate {
  double eager_peak = 0;
  double sharded_peak = 0;
  double after_wrap = 0;
};
ConstructionEstimate estimate_construction(const std::vector<int64_t>& unit_numels, int64_t outside_numel,
                                           int world_size, ShardingStrategy strategy = ShardingStrategy::kFullShard,
                                           int shard_group_size = 0, int64_t param_bytes = 4);

}  // namespace fsdp
