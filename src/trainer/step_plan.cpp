#include "step_plan.h"

#include <c10/util/Exception.h>

namespace fsdp::trainer::detail {

StepPlan::StepPlan(const LoopContext& ctx)
    : data_(ctx.data),
      sampler_(ctx.data.train_size, ctx.options.global_batch_size(), ctx.options.shuffle(), ctx.options.seed(),
               ctx.options.last_batch() == LastBatch::kDrop) {
  const TrainerOptions& o = ctx.options;
  steps_per_epoch_ = data_.batch_indices ? data_.steps_per_epoch : sampler_.steps_per_epoch();
  TORCH_CHECK(steps_per_epoch_ > 0, ctx.program(), ": the batch sampler's steps per epoch must be positive, got ",
              steps_per_epoch_);
  total_steps_ = o.max_steps() > 0 ? o.max_steps() : o.max_epochs() * steps_per_epoch_;
}

std::vector<int64_t> StepPlan::batch(int64_t step) {
  if (data_.batch_indices) return data_.batch_indices(step);
  return sampler_.batch_indices(step / steps_per_epoch_, step % steps_per_epoch_);
}

}  // namespace fsdp::trainer::detail
