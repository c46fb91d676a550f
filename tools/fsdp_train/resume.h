#pragma once
/// --checkpoint-dir / --resume: what fsdp-train stores with a checkpoint besides the
/// weights and the optimizer state (those are fsdp::save_checkpoint's), and the checks
/// that a resumed run continues the same run.
///
/// [Note: training state] The data a step trains on is a pure function of (--seed, step,
/// --batch-size, --no-shuffle) (see task.h), so the data position is the step count: a
/// checkpoint stores the step, the flags that fix the model and the data, and torch's CPU
/// RNG state (nothing in the loop draws from it today; a dropout or a random augmentation
/// added later would, and resuming must not silently change it). fp32 and bf16 training use
/// no loss scaler, so there is no scaler state. Flags that differ from the checkpoint's are
/// refused rather than taken from it, so the command line always says what runs.

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/state/checkpoint.h"
#include "fsdp/trainer/checkpoint_dir.h"
#include "options.h"

namespace fsdp::train {

/// `dir`/step-`step`: the checkpoint after `step` optimizer steps (the checkpoint
/// directory's layout is the library's, include/fsdp/trainer/checkpoint_dir.h).
using fsdp::trainer::checkpoint_path;

/// The extras saved with the checkpoint after `step` steps (see [Note: training state]).
fsdp::CheckpointExtra training_state(const TrainOptions& o, int64_t step);

/// Empty if the saved values (a checkpoint's extras) match `o`'s flags, else a message naming
/// the first flag that differs and the value to pass.
std::string check_compatible(const TrainOptions& o, const std::map<std::string, std::string>& saved);

/// Empty if o.resume is empty, or names a checkpoint written by fsdp-train with flags `o`
/// matches; else the message. Reads only its metadata.json (fast: before any rank starts).
std::string check_resume(const TrainOptions& o);

/// --resume auto on rank 0: the step of the newest complete checkpoint under
/// o.checkpoint_dir, older than step `below`, that check_resume accepts for o (readable
/// metadata, same model and data flags); nullopt if there is none. Each newer one passed over
/// is described in `skipped`.
std::optional<int64_t> newest_usable_checkpoint(const TrainOptions& o, std::vector<std::string>& skipped,
                                                int64_t below = std::numeric_limits<int64_t>::max());

/// Restores torch's CPU RNG from `extra` and returns the step the checkpoint was taken at.
int64_t restore_training_state(const fsdp::CheckpointExtra& extra);

}  // namespace fsdp::train
