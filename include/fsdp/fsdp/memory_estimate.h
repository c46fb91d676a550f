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

#include "fsdp/fsdp/options.h"

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

}  // namespace fsdp
