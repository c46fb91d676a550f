#pragma once
/// Sharded checkpoint directories: every rank writes its own pieces in parallel,
/// rank 0 writes one metadata file, and the directory appears atomically.
///
///     fsdp::CheckpointExtra extra;
///     extra.values["step"] = std::to_string(step);
///     extra.tensors["rng"] = torch::make_generator<at::CPUGeneratorImpl>().get_state();
///     fsdp::save_checkpoint("ckpt/latest", *model, &optimizer, extra);   // collective
///     ...
///     auto loaded = fsdp::load_checkpoint("ckpt/latest", *model, &optimizer);  // any world size
///
/// Files are described per *original* parameter (its name in the unwrapped model
/// and the element range of its flattened values each record holds), never per
/// flat buffer, so a checkpoint saved at world size N under one strategy and wrap
/// policy loads at any world size M under any strategy and policy: each rank
/// reads only the records that overlap its own pieces (resharding N -> M) and
/// never materialises a full parameter it does not own. On-disk format:
/// docs/checkpoint-format.md.
///
/// Crash safety: the files are written and fsync'd into `<dir>.tmp`, and rank 0
/// renames that into place only after every rank has finished (a collective
/// confirms it). An existing `<dir>` is first renamed to `<dir>.old` and removed
/// after the new one is in place; load_checkpoint falls back to `<dir>.old` when
/// a crash fell between the two renames. Every record carries a CRC-32; a
/// truncated or corrupted file fails the load (on every rank, changing nothing)
/// with an error naming the file.
///
/// Optimizer state: torch::optim::Adam, AdamW, SGD and fsdp::optim::CPUAdam. Its
/// tensors are shaped like the parameters' pieces, so they reshard exactly like
/// the parameters; `step` is one integer per parameter. Loading creates state
/// entries keyed by each parameter's own TensorImpl (as libtorch optimizers key
/// them), so the next step continues Adam rather than restarting it. Adam-family
/// checkpoints (Adam, AdamW, CPUAdam) load into any Adam-family optimizer.

#include <map>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "fsdp/core/fully_sharded.h"

namespace fsdp {

/// User data saved with a checkpoint (rank 0's values are saved).
struct CheckpointExtra {
  /// Small values: step, data position, loss-scaler state, ... (kept in metadata.json).
  std::map<std::string, std::string> values;
  /// Tensors (e.g. an RNG state): written whole, by rank 0, into its shard file.
  std::map<std::string, at::Tensor> tensors;
};

/// Saves this rank's pieces of `model`'s parameters and buffers and of
/// `optimizer`'s state (nullptr: parameters only) into `dir`. Collective over the
/// model's process group. `dir` must be one directory for every rank: across machines,
/// on a file system every node mounts at the same path (NFS, Lustre, ...). The save
/// checks that first (rank 0 writes a probe file, every rank reads it) and, before
/// writing anything, fails on every rank with an error naming the ranks and hosts that
/// do not see it.
/// Units must be idle (call it between steps). Under HYBRID_SHARD the first
/// replica group writes; under NO_SHARD one replica
/// (rank 0) writes. Replaces an existing checkpoint at `dir` atomically.
void save_checkpoint(const std::string& dir, FullyShardedBase& model, const torch::optim::Optimizer* optimizer,
                     const CheckpointExtra& extra = {});

/// Loads a checkpoint saved at any world size, strategy and wrap policy into
/// `model` (and `optimizer`'s state, unless nullptr; the learning rate of each
/// parameter group too). Parameters the checkpoint lacks, or ones whose shape or
/// dtype differ, are errors naming the parameter. Returns the saved extras.
/// Collective over the model's process group (one all-reduce of a flag).
///
/// All or nothing, on every rank: every rank first checks and checksums all it
/// would read; if any rank finds a problem (a missing, truncated or corrupted
/// file, a record that fails its CRC-32, a parameter the checkpoint lacks or
/// has with another shape), every rank throws an error naming the failing
/// rank(s), file and record, and no rank has changed its parameters, buffers,
/// optimizer state or learning rates: the caller may load another checkpoint.
/// See [Note: atomic load] in src/state/checkpoint_load.cpp for how and what it costs.
CheckpointExtra load_checkpoint(const std::string& dir, FullyShardedBase& model, torch::optim::Optimizer* optimizer);

}  // namespace fsdp
