#pragma once
/// The checkpoints the Trainer keeps under checkpoint_dir: DIR/step-S, complete once
/// they have that name (fsdp::save_checkpoint writes DIR/step-S.tmp and renames it at
/// the end, so a run killed mid-save leaves only a .tmp, which nothing here touches).
/// The idea of fsdp-train's tools/fsdp_train/checkpoint_dir.h, without its flags.

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::trainer::detail {

/// `dir`/step-`step`.
std::string checkpoint_path(const std::string& dir, int64_t step);
/// The steps S of the complete checkpoints DIR/step-S, ascending.
std::vector<int64_t> checkpoint_steps(const std::string& dir);
/// Deletes all but the `keep` newest; returns what it could not delete ("" if all went).
std::string prune_checkpoints(const std::string& dir, int64_t keep);
/// The "extra" values of DIR's metadata.json (or DIR.old's); false if unreadable.
bool read_checkpoint_values(const std::string& dir, std::vector<std::pair<std::string, std::string>>& values,
                            std::string& error);

}  // namespace fsdp::trainer::detail
