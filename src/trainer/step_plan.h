#pragma once
// Internal to src/trainer: which samples each optimizer step trains on, and how many
// steps the run has: the user's batch sampler (LoopData::batch_indices), or the
// GlobalSampler over the training set ([Note: global batches] in global_sampler.h).
#include <cstdint>
#include <vector>

#include "fsdp/trainer/global_sampler.h"
#include "loop_context.h"

namespace fsdp::trainer::detail {

class StepPlan {
 public:
  /// Checks that the batch sampler's epochs have steps.
  explicit StepPlan(const LoopContext& ctx);

  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  /// The step the run ends at, counted from its start (max_steps, else max_epochs).
  int64_t total_steps() const { return total_steps_; }
  /// 0-based epoch of step `step` (0-based).
  int64_t epoch(int64_t step) const { return step / steps_per_epoch_; }
  /// Sample indices of step `step`'s global batch, the same on every rank.
  std::vector<int64_t> batch(int64_t step);

 private:
  const LoopData& data_;
  GlobalSampler sampler_;
  int64_t steps_per_epoch_ = 0;
  int64_t total_steps_ = 0;
};

}  // namespace fsdp::trainer::detail
