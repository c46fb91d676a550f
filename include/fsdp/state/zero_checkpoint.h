#pragma once
/// Checkpoint directories of a fsdp::optim::ZeroRedundancyOptimizer, in the format of
/// fsdp::save_checkpoint (fsdp/state/checkpoint.h, docs/checkpoint-format.md): records per
/// original parameter, each rank writing the pieces it owns ([Note: ZeRO partition
/// layout]) and the optimizer state of those pieces. So a ZeRO checkpoint loads at any
/// world size and stage, and into a FullyShardedDataParallel of the same model (any
/// strategy), and an FSDP checkpoint loads into a ZeroRedundancyOptimizer:
///
///     fsdp::save_checkpoint("ckpt/step-100", opt, extra);     // collective
///     ...                                                      // any world size, stage 1 or 2
///     auto extra = fsdp::load_checkpoint("ckpt/step-100", opt);
///
/// The optimizer must have been built with ZeroOptions::module (names, buffers). What is
/// saved: every parameter of that module (trainable ones from their owners' pieces,
/// fp32 masters under mixed precision, as FSDP saves its fp32 shards; frozen ones and
/// parameters the optimizer does not hold from rank 0), its buffers (rank 0), the inner
/// optimizer's state of each piece, each group's learning rate (this optimizer's, which
/// an LR scheduler sets), and `extra`. The dynamic loss scaler's state is not saved: put
/// loss_scaler_state() into `extra` if you use one. Loading is all or nothing on every
/// rank ([Note: atomic load]); it then all-gathers the parameters
/// (ZeroRedundancyOptimizer::all_gather_parameters). Under mixed precision frozen
/// parameters are kept in param_dtype, so their records are too (an FSDP checkpoint holds
/// them in fp32: such a pair does not load into each other, with an error naming the
/// parameter and both dtypes).

#include <string>

#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/checkpoint.h"

namespace fsdp {

/// Saves the parameters, buffers and optimizer state `opt` manages into `dir`. Collective
/// over opt's process group; call it between steps. Replaces `dir` atomically.
void save_checkpoint(const std::string& dir, optim::ZeroRedundancyOptimizer& opt, const CheckpointExtra& extra = {});

/// save_checkpoint above, asynchronously (fsdp/state/async_checkpoint.h): returns once
/// this rank's snapshot is taken; a writer thread writes it while training goes on.
CheckpointHandle save_checkpoint_async(const std::string& dir, optim::ZeroRedundancyOptimizer& opt,
                                       const CheckpointExtra& extra = {}, const AsyncCheckpointOptions& options = {});

/// prepare_async_checkpoint (fsdp/state/async_checkpoint.h) of a ZeRO optimizer's state.
int64_t prepare_async_checkpoint(optim::ZeroRedundancyOptimizer& opt);

/// Loads a checkpoint saved by any world size, stage or FSDP strategy into `opt` and its
/// module; returns the saved extras. Collective over opt's process group.
CheckpointExtra load_checkpoint(const std::string& dir, optim::ZeroRedundancyOptimizer& opt);

}  // namespace fsdp
