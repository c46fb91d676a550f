#include "step_runner.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include <torch/torch.h>

#include "fsdp/trainer/memory_summary.h"

namespace fsdp::trainer::detail {

namespace {

/// Micro-batches with samples (all k of them unless the batch has fewer than k).
std::vector<std::pair<int64_t, int64_t>> micro_batches(int64_t m, int64_t k) {
  std::vector<std::pair<int64_t, int64_t>> micro;
  for (int64_t j = 0; j < k; ++j) {
    auto part = contiguous_part(m, k, j);
    if (part.second > part.first) micro.push_back(part);
  }
  return micro;
}

}  // namespace

StepRunner::StepRunner(const LoopContext& ctx, StepPlan& plan) : ctx_(ctx), plan_(plan) {
  want_memory_ = ctx.lead() && !ctx.options.metrics_file().empty();
  for (auto& cb : ctx.callbacks) want_memory_ = want_memory_ || cb->needs_memory();
}

RanStep StepRunner::run(int64_t step) {
  const auto t_step = LoopClock::now();
  const std::vector<int64_t> batch = plan_.batch(step);
  const int64_t m = int64_t(batch.size());
  TORCH_CHECK(m > 0, ctx_.program(), ": the batch sampler gave step ", step,
              " no samples; give every step at least one");
  const double lr = ctx_.model.optimizer->param_groups().at(0).options().get_lr();
  clear_gradients();
  const LossSums sums = forward_backward(batch, step);
  optimizer_step(step);

  RanStep ran;
  StepMetrics& sm = ran.metrics;
  sm.step = step + 1;
  sm.epoch = plan_.epoch(step);
  sm.samples = m;
  sm.lr = lr;
  sm.samples_per_s = double(m) / std::max(1e-9, std::chrono::duration<double>(LoopClock::now() - t_step).count());
  if (want_memory_) sm.memory = model_memory(ctx_.model.fsdp, *ctx_.model.optimizer);
  share_of_loss(sums, m, ran);
  return ran;
}

// [Note: step loss] With equal parts (m divisible by k x world) the step's loss is
// the plain mean of the parts' means: each rank's mean of its micro-batch means,
// then the mean over ranks (ReduceOp::kAvg's sum / world). That is the mean over
// the global batch, rounded as data-parallel PyTorch (and fsdp-train's tests'
// reference) computes it; with k = 1 a rank's value is its loss as returned.
// Unequal parts (a short last batch) weigh each rank's samples by count instead.
void StepRunner::share_of_loss(const LossSums& sums, int64_t m, RanStep& ran) const {
  const int64_t k = ctx_.options.accumulate_grad_batches();
  if (m % (k * ctx_.world()) == 0) {
    ran.local_loss = sums.means / double(k);
    ran.loss_divisor = double(ctx_.world());
  } else {
    ran.local_loss = sums.loss;
    ran.loss_divisor = double(m);
  }
}

void StepRunner::clear_gradients() {
  // Gradients are set to none, not filled with zeros (PyTorch 2's default, and
  // ZeroRedundancyOptimizer's): the next backward then assigns each gradient instead
  // of adding it to zeros, and no pass writes the zeros. On a step bound by memory
  // traffic that is two passes over the gradient shard fewer (docs/benchmarks.md,
  // "The step is bound by memory traffic"). Values are the same; only a -0 gradient
  // element stays -0 where +0 + -0 gave +0.
  if (ctx_.model.zero) {
    ctx_.model.zero->zero_grad(/*set_to_none=*/true);
    return;
  }
  ctx_.model.optimizer->zero_grad(/*set_to_none=*/true);
}

StepRunner::LossSums StepRunner::forward_backward(const std::vector<int64_t>& batch, int64_t step) {
  const auto micro = micro_batches(int64_t(batch.size()), ctx_.options.accumulate_grad_batches());
  LossSums sums;
  for (size_t j = 0; j < micro.size(); ++j) train_part(batch, micro[j], {step, j, micro.size()}, sums);
  return sums;
}

/// This rank's part of micro-batch [micro.first, micro.second) of `batch`: forward and
/// backward, its loss weighted by the part's share of the global batch.
void StepRunner::train_part(const std::vector<int64_t>& batch, std::pair<int64_t, int64_t> micro, PartOf where,
                            LossSums& sums) {
  const bool last = where.micro + 1 == where.micros;
  const int rank = ctx_.rank(), world = ctx_.world();
  const int64_t m = int64_t(batch.size());
  const auto [a, b] = micro;
  const auto [lo, hi] = contiguous_part(b - a, world, rank);
  std::vector<int64_t> idx(batch.begin() + a + lo, batch.begin() + a + hi);
  const int64_t mine = int64_t(idx.size());
  if (mine == 0) idx.push_back(batch[size_t(a)]);  // forward/backward are collective: run, weigh 0
  // Reductions average over ranks; a rank's mean of `mine` samples enters the
  // step's mean over m samples with weight mine/m, hence mine*world/m here
  // (= 1/k for k equal micro-batches).
  const double weight = double(mine) * double(world) / double(m);
  std::optional<FullyShardedBase::NoSyncGuard> no_sync;
  if (ctx_.model.fsdp && !last) no_sync.emplace(ctx_.model.fsdp->no_sync());
  // ZeRO-2 reduces every micro-batch; under optimizer_in_backward only the last one steps.
  std::optional<optim::ZeroRedundancyOptimizer::NoStepGuard> no_step;
  if (ctx_.model.zero && !last && ctx_.model.zero->options().optimizer_in_backward())
    no_step.emplace(ctx_.model.zero->no_step());
  at::Tensor loss;
  try {
    loss = ctx_.data.train_step(idx);
  } catch (c10::Error& e) {
    // Where it happened, which the batch function and the user's step do not know.
    TORCH_RETHROW(e, ctx_.program(), " (rank ", rank, "): training step ", where.step + 1, " of ",
                  plan_.total_steps(), ", micro-batch ", where.micro + 1, " of ", where.micros);
  }
  TORCH_CHECK(loss.defined() && loss.numel() == 1 && loss.requires_grad(), ctx_.program(), " (rank ", rank,
              "): the training step must return the scalar mean loss of its batch, attached to the graph; got ",
              loss.defined() ? loss.sizes() : at::IntArrayRef{});
  (weight == 1.0 ? loss : loss * weight).backward();
  if (mine > 0) {
    const double mean = loss.item<double>();
    sums.loss += mean * double(mine);
    sums.means += mean;
  }
}

void StepRunner::optimizer_step(int64_t step) {
  const LoopModel& m = ctx_.model;
  const double clip = ctx_.options.gradient_clip_val();
  if (m.fsdp && clip > 0) m.fsdp->clip_grad_norm_(clip);
  m.optimizer->step();  // zero1/zero2 clip inside step() (ZeroOptions::clip_grad_norm)
  if (m.scheduler) m.scheduler->step();
  for (auto& cb : ctx_.callbacks) cb->on_optimizer_step(step + 1);
}

}  // namespace fsdp::trainer::detail
