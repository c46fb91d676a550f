#pragma once
/// The checkpoints fsdp-train keeps under --checkpoint-dir DIR: which one `--resume auto`
/// continues from, and which ones `--keep-checkpoints K` deletes.
///
/// A checkpoint DIR/step-S is complete once it has that name: fsdp::save_checkpoint writes
/// DIR/step-S.tmp and renames it at the end, so a run killed mid-save leaves only a .tmp,
/// which neither function below touches.

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "options.h"

namespace fsdp::train {

/// The steps S of the complete checkpoints DIR/step-S, ascending.
std::vector<int64_t> checkpoint_steps(const std::string& dir);

/// --resume auto on rank 0: the step of the newest complete checkpoint under
/// o.checkpoint_dir, older than step `below`, that check_resume accepts for o (readable
/// metadata, same model and data flags); nullopt if there is none. Each newer one passed over
/// is described in `skipped`.
std::optional<int64_t> newest_usable_checkpoint(const TrainOptions& o, std::vector<std::string>& skipped,
                                                int64_t below = std::numeric_limits<int64_t>::max());

/// --keep-checkpoints K (K > 0) on rank 0 after a save: deletes all but the K newest complete
/// checkpoints. Returns what it could not delete ("" if everything went).
std::string prune_checkpoints(const std::string& dir, int64_t keep);

}  // namespace fsdp::train
