#pragma once
/// --checkpoint-dir / --resume: what fsdp-train stores with a checkpoint besides what the
/// library's loop stores (the weights, the optimizer state, the step and every rank's
/// RNG state: [Note: trainer checkpoint state] in src/trainer/trainer_state.h), and the
/// checks that a resumed run continues the same run.
///
/// [Note: training state] The data a step trains on is a pure function of (--seed, step,
/// --batch-size, --no-shuffle) (see task.h), so the data position is the step count. A
/// checkpoint also stores the flags that fix the model, the data and the optimizer; flags
/// that differ from the checkpoint's are refused rather than taken from it, so the
/// command line always says what runs. fp32 and bf16 training use no loss scaler, so there
/// is no scaler state.

#include <map>
#include <string>

#include "fsdp/state/checkpoint.h"
#include "fsdp/trainer/checkpoint_dir.h"
#include "options.h"

namespace fsdp::train {

/// `dir`/step-`step`: the checkpoint after `step` optimizer steps (the checkpoint
/// directory's layout is the library's, include/fsdp/trainer/checkpoint_dir.h).
using fsdp::trainer::checkpoint_path;

/// Adds fsdp-train's extras (see [Note: training state]) to a checkpoint's.
void add_training_state(const TrainOptions& o, fsdp::CheckpointExtra& extra);

/// Empty if the saved values (a checkpoint's extras) match `o`'s flags, else a message naming
/// the first flag that differs and the value to pass.
std::string check_compatible(const TrainOptions& o, const std::map<std::string, std::string>& saved);

/// Empty if o.resume is empty or "auto", or names a checkpoint written by fsdp-train with
/// flags `o` matches; else the message. Reads only its metadata.json (fast: before any rank
/// starts). "auto" is resolved by the loop on rank 0, which passes over the checkpoints
/// check_compatible refuses.
std::string check_resume(const TrainOptions& o);

}  // namespace fsdp::train
