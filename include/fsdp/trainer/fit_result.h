#pragma once
/// What fsdp::trainer::Trainer::fit() returns on every rank.

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/state/async_checkpoint.h"

namespace fsdp::trainer {

struct FitResult {
  /// The step training continued from (0 fresh; S after resuming DIR/step-S).
  int64_t first_step = 0;
  /// Steps done in all when fit returned (first_step + steps this call ran).
  int64_t last_step = 0;
  /// The checkpoint resumed from ("" when none).
  std::string resumed_from;
  /// Global mean loss of each step this call ran, in order.
  std::vector<double> losses;
  /// The last validation's metrics (empty without validation).
  std::map<std::string, double> validation;
  /// Wall time of this call's training steps, from the first step's start to the last
  /// step's end, less the validations and checkpoints between them: what a throughput
  /// (samples of last_step - first_step steps / train_seconds) should divide by.
  double train_seconds = 0;
  /// Each checkpoint this call saved, in order: its step and what it cost this rank
  /// (the training thread's blocked time, the writer's time and bytes).
  std::vector<std::pair<int64_t, CheckpointSaveStats>> checkpoints;
};

}  // namespace fsdp::trainer
