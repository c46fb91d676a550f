#pragma once
// Internal to src/trainer: the checkpoints of a run, under checkpoint_dir/step-S:
// every checkpoint_interval steps and after the last step (and step-0 of a fresh run
// with checkpoint_at_start). Each holds the model, the optimizer, the loop's state
// ([Note: trainer checkpoint state] in trainer_state.h) and the callbacks'; older ones
// beyond keep_checkpoints are deleted. Its time is not training time.
// With async_checkpoint a save returns once its snapshot is taken; poll(), at every step
// boundary, publishes the written one (then prunes, then on_checkpoint) and raises a failed
// one; finish() waits for the last.
#include <cstdint>
#include <string>

#include "fsdp/state/async_checkpoint.h"
#include "fsdp/trainer/fit_result.h"

#include "loop_context.h"

namespace fsdp::trainer::detail {

class CheckpointSchedule {
 public:
  CheckpointSchedule(const LoopContext& ctx, int64_t total_steps, Progress& progress, FitResult& result);

  /// Whether a checkpoint is due after `step` steps.
  bool due(int64_t step) const;
  /// Saves the state after `step` steps (collective; nothing without checkpoint_dir):
  /// blocking, or started (async_checkpoint), after the previous save is settled.
  void save(int64_t step);
  /// At a step boundary: completes a finished asynchronous save (publish, prune,
  /// on_checkpoint) or raises its error. Never blocks. The first, after the run's first
  /// optimizer step, moves the state onto pages of its own for the saves to come
  /// (prepare_async_checkpoint), so that no save's stall holds that copy.
  void poll();
  /// Waits for the save in flight and completes it (the end of fit()).
  void finish();
  /// Seconds spent saving so far.
  double seconds() const { return seconds_; }

 private:
  void prepare();
  void prune();
  void complete();  // the save in flight is published (or throws): prune, on_checkpoint

  FitResult& result_;
  CheckpointHandle in_flight_;
  std::string in_flight_dir_;
  int64_t in_flight_step_ = -1;
  const LoopContext& ctx_;
  Progress& progress_;
  const int64_t total_steps_;
  double seconds_ = 0;
  bool prepared_ = false;
};

}  // namespace fsdp::trainer::detail
