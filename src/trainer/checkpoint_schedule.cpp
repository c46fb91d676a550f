#include "checkpoint_schedule.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/zero_checkpoint.h"
#include "fsdp/trainer/checkpoint_dir.h"
#include "trainer_state.h"

namespace fsdp::trainer::detail {

CheckpointSchedule::CheckpointSchedule(const LoopContext& ctx, int64_t total_steps, Progress& progress,
                                       FitResult& result)
    : ctx_(ctx), progress_(progress), total_steps_(total_steps), result_(result) {}

bool CheckpointSchedule::due(int64_t step) const {
  const int64_t every = ctx_.options.checkpoint_interval();
  return step == total_steps_ || (every > 0 && step % every == 0);
}

void CheckpointSchedule::save(int64_t step) {
  const TrainerOptions& o = ctx_.options;
  if (o.checkpoint_dir().empty()) return;
  const auto t0 = LoopClock::now();
  CheckpointExtra extra = trainer_state(o, ctx_.data.train_size, ctx_.pg, step);
  for (auto& cb : ctx_.callbacks) cb->on_save_checkpoint(extra);
  const std::string dir = checkpoint_path(o.checkpoint_dir(), step);
  const LoopModel& m = ctx_.model;
  finish();  // the previous save, published (or its error) before the next starts
  in_flight_ = m.zero ? save_checkpoint_async(dir, *m.zero, extra) : save_checkpoint_async(dir, *m.fsdp, m.optimizer, extra);
  in_flight_dir_ = dir;
  in_flight_step_ = step;
  if (!o.async_checkpoint()) finish();
  seconds_ += std::chrono::duration<double>(LoopClock::now() - t0).count();
}

void CheckpointSchedule::poll() {
  if (!prepared_) prepare();
  if (in_flight_.valid() && in_flight_.done()) complete();
}

void CheckpointSchedule::prepare() {
  prepared_ = true;
  const TrainerOptions& o = ctx_.options;
  if (o.checkpoint_dir().empty() || !o.async_checkpoint()) return;
  const auto t0 = LoopClock::now();
  const LoopModel& m = ctx_.model;
  if (m.zero) prepare_async_checkpoint(*m.zero);
  else prepare_async_checkpoint(*m.fsdp, m.optimizer);
  seconds_ += std::chrono::duration<double>(LoopClock::now() - t0).count();
}

void CheckpointSchedule::finish() {
  if (!in_flight_.valid()) return;
  const auto t0 = LoopClock::now();
  in_flight_.wait();
  complete();
  seconds_ += std::chrono::duration<double>(LoopClock::now() - t0).count();
}

void CheckpointSchedule::complete() {
  CheckpointHandle done = in_flight_;
  in_flight_ = CheckpointHandle();
  done.wait();  // throws the save's error; returns at once otherwise
  result_.checkpoints.emplace_back(in_flight_step_, done.stats());
  prune();
  for (auto& cb : ctx_.callbacks) cb->on_checkpoint(in_flight_dir_, in_flight_step_);
}

/// Rank 0 deletes the checkpoints beyond the newest keep_checkpoints.
void CheckpointSchedule::prune() {
  const TrainerOptions& o = ctx_.options;
  if (!ctx_.lead() || o.keep_checkpoints() <= 0) return;
  const PruneResult pruned = prune_checkpoints(o.checkpoint_dir(), o.keep_checkpoints());
  for (const std::string& old : pruned.deleted)
    say_on_lead(true, progress_, o.progress(),
                std::string(ctx_.program()) + ": deleted checkpoint " + old + ": keep_checkpoints " +
                    std::to_string(o.keep_checkpoints()) + " keeps only the newest (0 keeps all)");
  if (!pruned.failed.empty())
    std::fprintf(stderr, "%s: warning: keep_checkpoints could not delete %s\n", ctx_.program(), pruned.failed.c_str());
}

}  // namespace fsdp::trainer::detail
