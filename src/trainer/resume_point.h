#pragma once
// Internal to src/trainer: where a run starts. TrainerOptions::resume names a
// checkpoint ("" none, "auto" the newest usable one under checkpoint_dir); the model
// and optimizer are loaded from it and the loop's state continued: the step, the
// generators ([Note: trainer checkpoint state] in trainer_state.h), the LR
// scheduler's position and the callbacks' state.
#include <cstdint>
#include <optional>
#include <string>

#include "fsdp/state/checkpoint.h"
#include "loop_context.h"

namespace fsdp::trainer::detail {

struct ResumePoint {
  int64_t first_step = 0;    ///< steps already done (0: a fresh run)
  std::string resumed_from;  ///< the checkpoint directory ("" for a fresh run)
  std::optional<CheckpointExtra> extra;  ///< its extras, as on_load_checkpoint saw them
};

/// Loads the checkpoint the options name, if any, and continues its state on every
/// rank. Collective. Refuses a checkpoint of another data order (or one the user's
/// resume_check refuses) and one past `total_steps`.
ResumePoint load_resume_point(const LoopContext& ctx, int64_t total_steps);

}  // namespace fsdp::trainer::detail
