#pragma once
/// The checkpoints a training run keeps under one directory, DIR/step-S (the state
/// after S optimizer steps): used by fsdp::trainer::Trainer (checkpoint_dir,
/// keep_checkpoints, resume "auto") and by fsdp-train (--checkpoint-dir,
/// --keep-checkpoints, --resume auto), and usable by a hand-written loop.
///
/// A checkpoint DIR/step-S is complete once it has that name: fsdp::save_checkpoint
/// writes DIR/step-S.tmp and renames it at the end, so a run killed mid-save leaves
/// only a .tmp, which nothing here lists or deletes.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::trainer {

/// `dir`/step-`step`.
std::string checkpoint_path(const std::string& dir, int64_t step);
/// The steps S of the complete checkpoints DIR/step-S, ascending.
std::vector<int64_t> checkpoint_steps(const std::string& dir);
/// What prune_checkpoints did.
struct PruneResult {
  std::vector<std::string> deleted;  ///< the checkpoints it removed, oldest first
  std::string failed;                ///< what it could not remove, and why ("" if all went)
};
/// Deletes all but the `keep` (> 0) newest complete checkpoints. Call it on one rank,
/// after a save has returned.
PruneResult prune_checkpoints(const std::string& dir, int64_t keep);
/// The "extra" values of DIR's metadata.json (or DIR.old's, load_checkpoint's crash
/// fallback), without loading any tensor; false with `error` set ("no checkpoint there
/// (...)" or "unreadable metadata.json (...)") if there is none to read.
bool read_checkpoint_values(const std::string& dir, std::vector<std::pair<std::string, std::string>>& values,
                            std::string& error);

}  // namespace fsdp::trainer
