#pragma once
/// Model-state memory per rank, measured and estimated: the table fsdp::trainer::Trainer
/// prints at the end of fit() (TrainerOptions::memory_summary) and fsdp-train in its
/// summary, and the per-step MemorySample of the metrics file. Usable by a hand-written
/// loop over a FullyShardedDataParallel model or a ZeroRedundancyOptimizer.
///
/// The table, one row per rank (columns "params", "grads", "optim state", "peak
/// unsharded", "model state" = the first three, then the caller's own):
///     rank           params          grads    optim state   peak unsharded    model state
///     0           2.55 MiB       2.55 MiB       5.11 MiB         5.11 MiB      10.22 MiB

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/trainer/callback.h"
#include "fsdp/trainer/trainer_options.h"

namespace fsdp::trainer {

/// Bytes of the optimizer state tensors this rank holds: Adam / AdamW moments, SGD
/// momentum (other torch optimizers count 0); a ZeroRedundancyOptimizer's partition.
int64_t optimizer_state_bytes(torch::optim::Optimizer& opt);

/// This rank's model-state bytes now, from the FSDP wrapper `fsdp` (its shards and
/// unsharded peak), or, with `fsdp` null, from `opt`, which must then be a
/// ZeroRedundancyOptimizer (its parameters, masters and gradient partition); the
/// optimizer state from `opt`; rss_bytes the process's resident set.
MemorySample model_memory(FullyShardedBase* fsdp, torch::optim::Optimizer& opt);

/// The ZeRO accounting for a run's strategy, in bytes per rank with Adam: ZERO1 / ZERO2
/// (estimate_zero_model_state) or an FSDP kind (estimate_model_state with the sharding
/// strategy of strategy.resolved_fsdp(); `shard_group_size`: HYBRID_SHARD's group).
/// `bf16`: bf16 parameters with fp32 masters, which changes zero1/zero2's figures only
/// (FSDP's mixed precision keeps fp32 shards and gathers bf16 copies transiently).
double model_state_estimate(const Strategy& strategy, int64_t num_params, int world_size, int shard_group_size,
                            bool bf16);

/// A column after "model state": its header and this rank's value in bytes.
struct MemoryColumn {
  std::string name;
  double bytes = 0;
};

/// Collective over `pg`: each rank's `sample` and `extra` (the same names, in the same
/// order, on every rank) go to rank 0, which prints the table to `out`.
void print_memory_table(std::FILE* out, const comm::ProcessGroup& pg, const MemorySample& sample,
                        const std::vector<MemoryColumn>& extra = {});

/// "1.23 MiB" style (B, KiB, MiB, GiB, TiB; bytes without decimals).
void format_bytes(double bytes, char* out, size_t size);

}  // namespace fsdp::trainer
