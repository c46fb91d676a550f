#include "fsdp/fsdp/memory_estimate.h"

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
    case ShardingStrategy::NO_SHARD:
      e = {p * psi, p * psi, o * psi};
      break;
    case ShardingStrategy::SHARD_GRAD_OP:
      e = {p * psi, p * psi / n, o * psi / n};
      break;
    case ShardingStrategy::HYBRID_SHARD: {
      TORCH_CHECK(shard_group_size >= 1 && world_size % shard_group_size == 0,
                  "fsdp: estimate_model_state for HYBRID_SHARD needs a shard_group_size dividing the world size ",
                  world_size, ", got ", shard_group_size);
      n = shard_group_size;
      [[fallthrough]];
    }
    case ShardingStrategy::FULL_SHARD:
      e = {p * psi / n, p * psi / n, o * psi / n};
      break;
  }
  return e;
}

}  // namespace fsdp
