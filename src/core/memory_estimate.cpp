#include "fsdp/core/memory_estimate.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace fsdp {

ModelStateEstimate estimate_model_state(int64_t num_params, int world_size, ShardingStrategy strategy,
                                        int shard_group_size, int64_t param_bytes, int64_t optim_bytes) {
  TORCH_CHECK(num_params >= 0 && world_size >= 1 && param_bytes > 0 && optim_bytes >= 0,
              "fsdp: estimate_model_state needs num_params >= 0, world_size >= 1, param_bytes > 0 and "
              "optim_bytes >= 0; got ", num_params, ", ", world_size, ", ", param_bytes, ", ", optim_bytes);
  const double psi = double(num_params), p = double(param_bytes), o = double(optim_bytes);
  double n = world_size;
  ModelStateEstimate e;
  switch (strategy) {
    case ShardingStrategy::kNoShard:
      e = {p * psi, p * psi, o * psi};
      break;
    case ShardingStrategy::kShardGradOp:
      e = {p * psi, p * psi / n, o * psi / n};
      break;
    case ShardingStrategy::kHybridShard: {
      TORCH_CHECK(shard_group_size >= 1 && world_size % shard_group_size == 0,
                  "fsdp: estimate_model_state for HYBRID_SHARD needs a shard_group_size dividing the world size ",
                  world_size, ", got ", shard_group_size);
      n = shard_group_size;
      [[fallthrough]];
    }
    case ShardingStrategy::kFullShard:
      e = {p * psi / n, p * psi / n, o * psi / n};
      break;
  }
  return e;
}

ConstructionEstimate estimate_construction(const std::vector<int64_t>& unit_numels, int64_t outside_numel,
                                           int world_size, ShardingStrategy strategy, int shard_group_size,
                                           int64_t param_bytes) {
  TORCH_CHECK(world_size >= 1 && outside_numel >= 0 && param_bytes > 0, "fsdp: estimate_construction needs "
              "world_size >= 1, outside_numel >= 0 and param_bytes > 0; got ", world_size, ", ", outside_numel, ", ",
              param_bytes);
  int64_t n = world_size;
  if (strategy == ShardingStrategy::kNoShard) n = 1;
  if (strategy == ShardingStrategy::kHybridShard) {
    TORCH_CHECK(shard_group_size >= 1 && world_size % shard_group_size == 0, "fsdp: estimate_construction for "
                "HYBRID_SHARD needs a shard_group_size dividing the world size ", world_size, ", got ",
                shard_group_size);
    n = shard_group_size;
  }
  auto chunk = [n](int64_t numel) { return (numel + n - 1) / n; };
  int64_t total = outside_numel, shards = 0, largest_chunk = 0, building = 0;
  for (int64_t u : unit_numels) {
    TORCH_CHECK(u >= 0, "fsdp: estimate_construction: a unit of ", u, " parameters");
    total += u;
    largest_chunk = std::max(largest_chunk, chunk(u));
    shards += chunk(u);
    building = std::max(building, shards + u);
  }
  const double p = double(param_bytes);
  ConstructionEstimate e;
  e.eager_peak = p * double(total + std::max(largest_chunk, chunk(outside_numel)));
  e.sharded_peak = p * double(std::max(building + outside_numel, shards + outside_numel + chunk(outside_numel)));
  e.after_wrap = p * double(shards + chunk(outside_numel));
  return e;
}

ModelStateEstimate estimate_zero_model_state(int64_t num_params, int world_size, int stage, int64_t param_bytes,
                                             int64_t optim_bytes) {
  TORCH_CHECK(num_params >= 0 && world_size >= 1 && (stage == 1 || stage == 2) && (param_bytes == 2 || param_bytes == 4) &&
                  optim_bytes >= 0,
              "fsdp: estimate_zero_model_state needs num_params >= 0, world_size >= 1, stage 1 or 2, param_bytes 2 "
              "(bf16) or 4 (fp32) and optim_bytes >= 0; got ",
              num_params, ", ", world_size, ", ", stage, ", ", param_bytes, ", ", optim_bytes);
  const double psi = double(num_params), p = double(param_bytes), o = double(optim_bytes), n = world_size;
  // Below fp32 the partition also holds fp32 masters and the fp32 reduced gradients.
  const double partition_fp32 = param_bytes == 4 ? 0 : 4 * psi / n;
  ModelStateEstimate e;
  e.param_bytes = p * psi + partition_fp32;
  e.grad_bytes = stage == 1 ? p * psi + partition_fp32 : 4 * psi / n;
  e.optim_bytes = o * psi / n;
  return e;
}

}  // namespace fsdp
