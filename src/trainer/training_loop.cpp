// run_training_loop: the phases in order. Each lives in a file of its own: where the
// run starts (resume_point), which samples each step takes (step_plan), one step
// (step_runner), its report once the loss is known (step_reporter), and the
// validations and checkpoints between steps (validation_schedule,
// checkpoint_schedule).
#include "fsdp/trainer/training_loop.h"

#include <chrono>
#include <cstdio>
#include <utility>

#include <unistd.h>

#include <torch/torch.h>

#include "checkpoint_schedule.h"
#include "fsdp/trainer/memory_summary.h"
#include "fsdp/trainer/metrics_log.h"
#include "fsdp/trainer/progress.h"
#include "loop_context.h"
#include "resume_point.h"
#include "weights_exchange.h"
#include "step_plan.h"
#include "step_reporter.h"
#include "step_runner.h"
#include "validation_schedule.h"

namespace fsdp::trainer::detail {

namespace {

void check_model(const LoopModel& m, const char* program) {
  TORCH_CHECK(m.optimizer && m.module && (m.fsdp != nullptr) != (m.zero != nullptr), program,
              ": run_training_loop needs LoopModel::optimizer, ::module and exactly one of ::fsdp (the FSDP "
              "wrapper) and ::zero (the ZeroRedundancyOptimizer, also ::optimizer); got optimizer ",
              m.optimizer ? "set" : "null", ", module ", m.module ? "set" : "null", ", fsdp ",
              m.fsdp ? "set" : "null", ", zero ", m.zero ? "set" : "null");
  TORCH_CHECK(!m.zero || m.optimizer == m.zero, program,
              ": LoopModel::zero and ::optimizer must be the same ZeroRedundancyOptimizer");
}

/// on_train_start, and step-0 of a fresh run with checkpoint_at_start (a resumed run
/// does not rewrite the checkpoint it started from).
void start_training(const LoopContext& ctx, const ResumePoint& from, int64_t total_steps,
                    CheckpointSchedule& checkpoints) {
  TrainStart start;
  start.rank = ctx.rank();
  start.world_size = ctx.world();
  start.first_step = from.first_step;
  start.total_steps = total_steps;
  start.resumed_from = from.resumed_from;
  for (auto& cb : ctx.callbacks) cb->on_train_start(start);
  if (ctx.options.checkpoint_at_start() && from.first_step == 0) checkpoints.save(0);
  ctx.model.module->train();
}

/// The host memory the last checkpoint's snapshot held on rank 0 (AsyncCheckpointOptions::
/// host_snapshot_bytes bounds it).
void print_snapshot_memory(const std::pair<int64_t, CheckpointSaveStats>& last) {
  const CheckpointSaveStats& c = last.second;
  char copied[32], cow[32];
  format_bytes(double(c.snapshot_bytes + c.cow_pages_copied * int64_t(::sysconf(_SC_PAGESIZE))), copied, sizeof copied);
  format_bytes(double(c.cow_bytes), cow, sizeof cow);
  std::fprintf(stderr, "  checkpoint snapshot (rank 0, step-%lld): held %s of copies, protected %s copy-on-write\n",
               static_cast<long long>(last.first), copied, cow);
}

/// Rank 0 prints each rank's model-state bytes next to unsharded Adam training's 16 B
/// per parameter and the ZeRO accounting for the strategy (collective).
void print_memory_summary(const LoopContext& ctx, const FitResult& result) {
  const Strategy& strategy = ctx.options.strategy();
  const LoopModel& m = ctx.model;
  int group = 0;
  bool bf16 = false;
  if (strategy.is_zero()) {
    bf16 = strategy.zero().param_dtype() == at::kBFloat16;
  } else {
    const auto fo = strategy.resolved_fsdp();
    group = fo.shard_group_size() > 0 ? fo.shard_group_size() : ctx.pg.local_world_size();
  }
  const double zero = model_state_estimate(strategy, m.num_params, ctx.world(), group, bf16);
  if (ctx.lead()) {
    char z[32], u[32];
    format_bytes(zero, z, sizeof z);
    format_bytes(16 * double(m.num_params), u, sizeof u);
    std::fprintf(stderr, "%s memory per rank (%lld parameters; unsharded Adam training holds %s; "
                 "ZeRO estimate for %s with Adam: %s):\n",
                 ctx.program(), (long long)m.num_params, u, strategy.name().c_str(), z);
  }
  print_memory_table(stderr, ctx.pg, model_memory(m.fsdp, *m.optimizer));
  if (ctx.lead() && !result.checkpoints.empty()) print_snapshot_memory(result.checkpoints.back());
}

/// The steps from `first_step` to the end, with the checkpoints and validations due
/// between them; returns their seconds less those pauses (FitResult::train_seconds).
double train_steps(const LoopContext& ctx, StepPlan& plan, int64_t first_step, StepReporter& reporter,
                   CheckpointSchedule& checkpoints, ValidationSchedule& validations) {
  StepRunner runner(ctx, plan);
  const double paused_before = validations.seconds() + checkpoints.seconds();
  const auto t_train = LoopClock::now();
  for (int64_t step = first_step; step < plan.total_steps(); ++step) {
    const RanStep ran = runner.run(step);
    checkpoints.poll();
    reporter.add(ran);
    const int64_t done = ran.metrics.step;
    const bool save_now = checkpoints.due(done), validate_now = validations.due(done);
    // The global loss arrives after the next step's optimizer step unless something
    // between the steps needs it now ([Note: overlapped step loss]).
    reporter.report_until(ctx.options.overlap_step_metrics() && !save_now && !validate_now ? 1 : 0);
    if (save_now) checkpoints.save(done);
    if (validate_now) {
      validations.run(done);
      reporter.restart_interval();  // the steps so far are reported: validate_now drained them
    }
  }
  reporter.report_until(0);
  checkpoints.finish();
  const double paused = validations.seconds() + checkpoints.seconds() - paused_before;
  return std::chrono::duration<double>(LoopClock::now() - t_train).count() - paused;
}

FitResult run_phases(const LoopContext& ctx) {
  const TrainerOptions& o = ctx.options;
  StepPlan plan(ctx);
  const int64_t total_steps = plan.total_steps();
  const ResumePoint from = load_resume_point(ctx, total_steps);
  // A resumed run continues its checkpoint's weights; init_from starts a fresh one.
  if (!from.extra && !o.init_from().empty()) load_initial_weights(ctx);
  FitResult result;
  result.first_step = from.first_step;
  result.resumed_from = from.resumed_from;
  const bool append_metrics = from.first_step > 0 && o.metrics_append_on_resume();
  MetricsLog log(ctx.lead() ? o.metrics_file() : "", append_metrics, o.metrics_validation_key());
  Progress progress(total_steps, o.progress() && ctx.lead(), from.first_step);
  if (append_metrics && log.enabled())
    say_on_lead(ctx.lead(), progress, o.progress(),
                std::string(ctx.program()) + ": resumed at step " + std::to_string(from.first_step) +
                    ": appending to the metrics file " + o.metrics_file() + " (its lines up to step " +
                    std::to_string(from.first_step) + " stay; metrics_append_on_resume(false) would start it afresh)");
  ValidationSchedule validations(ctx, log, progress, result);
  CheckpointSchedule checkpoints(ctx, total_steps, progress, result);
  start_training(ctx, from, total_steps, checkpoints);
  StepReporter reporter(ctx, log, progress, total_steps, result);
  result.train_seconds = train_steps(ctx, plan, from.first_step, reporter, checkpoints, validations);
  progress.finish();
  validations.finish(total_steps);
  if (!o.export_safetensors().empty()) export_weights(ctx);
  result.last_step = total_steps;
  if (o.memory_summary()) print_memory_summary(ctx, result);
  for (auto& cb : ctx.callbacks) cb->on_train_end(reporter.last());
  return result;
}

}  // namespace

}  // namespace fsdp::trainer::detail

namespace fsdp::trainer {

FitResult run_training_loop(const TrainerOptions& o, const comm::ProcessGroup& pg, const LoopModel& model,
                            const LoopData& data, const std::vector<std::shared_ptr<Callback>>& callbacks,
                            const LoopNames& names) {
  const detail::LoopContext ctx{o, pg, model, data, callbacks, names};
  detail::check_model(model, ctx.program());
  // Options::optimizer_in_backward: the loop's optimizer steps each unit inside backward;
  // its step() after backward then finds no gradient ([Note: optimizer in backward]).
  if (model.fsdp && model.fsdp->options().optimizer_in_backward())
    model.fsdp->register_optimizer_in_backward(*model.optimizer);
  return detail::run_phases(ctx);
}

}  // namespace fsdp::trainer
