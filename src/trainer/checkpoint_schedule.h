#pragma once
// Internal to src/trainer: the checkpoints of a run, under checkpoint_dir/step-S:
// every checkpoint_interval steps and after the last step (and step-0 of a fresh run
// with checkpoint_at_start). Each holds the model, the optimizer, the loop's state
// ([Note: trainer checkpoint state] in trainer_state.h) and the callbacks'; older ones
// beyond keep_checkpoints are deleted. Its time is not training time.
#include <cstdint>

#include "loop_context.h"

namespace fsdp::trainer::detail {

class CheckpointSchedule {
 public:
  CheckpointSchedule(const LoopContext& ctx, int64_t total_steps, Progress& progress);

  /// Whether a checkpoint is due after `step` steps.
  bool due(int64_t step) const;
  /// Saves the state after `step` steps (collective; nothing without checkpoint_dir),
  /// prunes, then on_checkpoint.
  void save(int64_t step);
  /// Seconds spent saving so far.
  double seconds() const { return seconds_; }

 private:
  void prune();

  const LoopContext& ctx_;
  Progress& progress_;
  const int64_t total_steps_;
  double seconds_ = 0;
};

}  // namespace fsdp::trainer::detail
