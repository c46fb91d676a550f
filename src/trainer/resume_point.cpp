#include "resume_point.h"

#include <cstdio>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/state/zero_checkpoint.h"
#include "fsdp/trainer/checkpoint_dir.h"
#include "trainer_state.h"

namespace fsdp::trainer::detail {

namespace {

std::vector<double> learning_rates(torch::optim::Optimizer& opt) {
  std::vector<double> lrs;
  for (auto& g : opt.param_groups()) lrs.push_back(g.options().get_lr());
  return lrs;
}

void set_learning_rates(torch::optim::Optimizer& opt, const std::vector<double>& lrs) {
  auto& groups = opt.param_groups();
  TORCH_INTERNAL_ASSERT(groups.size() == lrs.size());
  for (size_t i = 0; i < lrs.size(); ++i) groups[i].options().set_lr(lrs[i]);
}

/// "" if checkpoint `dir` with extra values `saved` continues this run: the user's
/// check (its own settings, named its way) first, then the data order's.
std::string resume_refusal(const LoopContext& ctx, const std::string& dir, const std::map<std::string, std::string>& saved) {
  std::string why = ctx.data.resume_check ? ctx.data.resume_check(dir, saved) : "";
  return why.empty() ? trainer_state_mismatch(ctx.options, ctx.data.train_size, dir, saved) : why;
}

// Both families write the same directory format (docs/checkpoint-format.md), so a
// ZeRO checkpoint resumes under FSDP and the other way round.
CheckpointExtra load_model_checkpoint(const LoopContext& ctx, const std::string& dir) {
  const LoopModel& m = ctx.model;
  return m.zero ? load_checkpoint(dir, *m.zero) : load_checkpoint(dir, *m.fsdp, m.optimizer);
}

/// Rank 0 only: the newest step below `below` whose checkpoint it can read and whose
/// values this run accepts, or -1; says why it passed over each other one.
int64_t newest_acceptable_step(const LoopContext& ctx, int64_t below) {
  const char* name = ctx.program();
  const char* flag = ctx.resume_setting();
  const std::string& root = ctx.options.checkpoint_dir();
  auto steps = checkpoint_steps(root);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (*it >= below) continue;
    const std::string dir = checkpoint_path(root, *it);
    std::vector<std::pair<std::string, std::string>> values;
    std::string why;
    // Every reason names the checkpoint: the loop's and the hook's say which they refused.
    if (read_checkpoint_values(dir, values, why)) why = resume_refusal(ctx, dir, {values.begin(), values.end()});
    else why = std::string(flag) + " " + dir + ": " + why;
    if (why.empty()) return *it;
    std::fprintf(stderr, "%s: %s auto: skipped: %s\n", name, flag, why.c_str());
  }
  std::fprintf(stderr, "%s: %s auto: no usable checkpoint under %s; starting fresh\n", name, flag, root.c_str());
  return -1;
}

/// Loads `dir`, or returns nothing when the load failed on some rank (every rank then
/// knows, and nothing changed: [Note: atomic load] in src/state/checkpoint_load.cpp).
std::optional<CheckpointExtra> try_load(const LoopContext& ctx, const std::string& dir) {
  try {
    return load_model_checkpoint(ctx, dir);
  } catch (const c10::Error& e) {
    const std::string why = e.what_without_backtrace();
    if (why.rfind("fsdp: load_checkpoint('", 0) != 0) throw;
    if (ctx.lead())
      std::fprintf(stderr, "%s: %s auto: skipped: %s\n", ctx.program(), ctx.resume_setting(), why.c_str());
    return std::nullopt;
  }
}

/// resume "auto": rank 0 chooses and tells the others, so that all load the same
/// checkpoint even while the directory changes. A load that fails on any rank fails on
/// every rank, so every rank passes over it together and tries the next older one.
ResumePoint load_newest_usable(const LoopContext& ctx) {
  int64_t below = std::numeric_limits<int64_t>::max();
  for (;;) {
    auto chosen = torch::full({1}, int64_t(-1), torch::kLong);
    if (ctx.lead()) chosen.fill_(newest_acceptable_step(ctx, below));
    comm::broadcast(ctx.pg, chosen, 0, {comm::Phase::kTrainer, "resume point"}).wait();
    const int64_t step = chosen.item<int64_t>();
    if (step < 0) return {};
    below = step;
    const std::string dir = checkpoint_path(ctx.options.checkpoint_dir(), step);
    if (auto extra = try_load(ctx, dir)) return {0, dir, std::move(extra)};
  }
}

/// The scheduler's position: replays its steps from the initial learning rates, then
/// keeps the checkpoint's (equal, unless the schedule changed).
void replay_scheduler(const LoopContext& ctx, int64_t steps, const std::vector<double>& initial_lrs) {
  torch::optim::Optimizer& opt = *ctx.model.optimizer;
  const std::vector<double> loaded = learning_rates(opt);
  set_learning_rates(opt, initial_lrs);
  for (int64_t s = 0; s < steps; ++s) ctx.model.scheduler->step();
  set_learning_rates(opt, loaded);
}

/// The loop's state after the model's: step, generators, scheduler, callbacks.
void continue_from(const LoopContext& ctx, ResumePoint& point, int64_t total_steps,
                   const std::vector<double>& initial_lrs) {
  const CheckpointExtra& extra = *point.extra;
  const std::string why = resume_refusal(ctx, point.resumed_from, extra.values);
  TORCH_CHECK(why.empty(), ctx.program(), " (rank ", ctx.rank(), "): resume: ", why);
  point.first_step = saved_step(extra);
  TORCH_CHECK(point.first_step <= total_steps, ctx.program(), ": resume ", point.resumed_from,
              ": the checkpoint is at step ", point.first_step, " but this run has only ", total_steps,
              " steps in all (max_steps / max_epochs count from the run's start); ask for more than ",
              point.first_step);
  restore_generator(extra, ctx.pg);
  if (ctx.model.scheduler) replay_scheduler(ctx, point.first_step, initial_lrs);
  for (auto& cb : ctx.callbacks) cb->on_load_checkpoint(extra);
}

}  // namespace

ResumePoint load_resume_point(const LoopContext& ctx, int64_t total_steps) {
  const std::vector<double> initial_lrs = learning_rates(*ctx.model.optimizer);
  const std::string& from = ctx.options.resume();
  ResumePoint point;
  if (from == "auto") point = load_newest_usable(ctx);
  else if (!from.empty()) point = {0, from, load_model_checkpoint(ctx, from)};
  if (point.extra) continue_from(ctx, point, total_steps, initial_lrs);
  return point;
}

}  // namespace fsdp::trainer::detail
