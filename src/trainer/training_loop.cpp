#include "fsdp/trainer/training_loop.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <mutex>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/zero_checkpoint.h"
#include "fsdp/trainer/checkpoint_dir.h"
#include "fsdp/trainer/global_sampler.h"
#include "fsdp/trainer/memory_summary.h"
#include "fsdp/trainer/metrics_log.h"
#include "fsdp/trainer/progress.h"
#include "fsdp/trainer/step_loss_reduction.h"

namespace fsdp::trainer::detail {

namespace {

using Clock = std::chrono::steady_clock;

// [Note: trainer checkpoint state]
// Besides the model and the optimizer (fsdp::save_checkpoint's), a checkpoint holds:
//  * trainer.step: optimizer steps done. The data position: step s's samples are a
//    pure function of (seed, epoch, step in epoch) ([Note: global batches]), so the
//    step is all the sampler needs.
//  * the values that fix the data order (seed, global batch size, dataset size,
//    shuffle, last batch policy): a resumed run with other values is refused naming
//    the value, rather than continuing on other data.
//  * trainer.world_size and one torch CPU generator state per rank
//    (trainer.rng.rank<r>): at the same world size each rank continues its own
//    stream; at another, every rank takes rank 0's.
//  * whatever callbacks add in on_save_checkpoint.
constexpr const char* kMarkerKey = "trainer.marker";
constexpr const char* kStepKey = "trainer.step";
constexpr const char* kWorldKey = "trainer.world_size";
constexpr const char* kRngPrefix = "trainer.rng.rank";

std::vector<std::pair<std::string, std::string>> fixed_values(const TrainerOptions& o, int64_t train_size) {
  return {{"trainer.seed", std::to_string(o.seed())},
          {"trainer.global_batch_size", std::to_string(o.global_batch_size())},
          {"trainer.train_size", std::to_string(train_size)},
          {"trainer.shuffle", o.shuffle() ? "true" : "false"},
          {"trainer.last_batch", o.last_batch() == LastBatch::kDrop ? "drop" : "short"}};
}

/// "" if `saved` (a checkpoint's extra values) continues the run `o` describes.
std::string incompatibility(const TrainerOptions& o, int64_t train_size, const std::string& dir,
                            const std::map<std::string, std::string>& saved) {
  if (saved.count(kMarkerKey) == 0 || saved.count(kStepKey) == 0)
    return dir + " holds no training-loop state (no " + kStepKey +
           " in its extras): it was saved outside fsdp::Trainer's loop (by fsdp::save_checkpoint directly, or by "
           "fsdp-train before it ran on that loop), so the step, data order and generators to continue from are "
           "unknown; start afresh, or load only its weights with fsdp::load_checkpoint";
  for (const auto& [key, value] : fixed_values(o, train_size)) {
    auto it = saved.find(key);
    const std::string was = it == saved.end() ? "(not recorded)" : it->second;
    if (was != value)
      return dir + " was saved with " + key.substr(8) + " " + was + " but this run has " + value +
             "; a resumed run must see the same data in the same order: set " + key.substr(8) + " to " + was +
             " or start afresh";
  }
  return "";
}

std::map<std::string, std::string> as_map(const std::vector<std::pair<std::string, std::string>>& v) {
  return {v.begin(), v.end()};
}

MemorySample memory_now(const LoopModel& m) { return model_memory(m.fsdp, *m.optimizer); }

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

void zero_grad(const LoopModel& m) {
  // Gradients are set to none, not filled with zeros (PyTorch 2's default, and
  // ZeroRedundancyOptimizer's): the next backward then assigns each gradient instead
  // of adding it to zeros, and no pass writes the zeros. On a step bound by memory
  // traffic that is two passes over the gradient shard fewer (docs/benchmarks.md,
  // "The step is bound by memory traffic"). Values are the same; only a -0 gradient
  // element stays -0 where +0 + -0 gave +0.
  if (m.zero) {
    m.zero->zero_grad(/*set_to_none=*/true);
    return;
  }
  m.optimizer->zero_grad(/*set_to_none=*/true);
}

/// Every rank's torch CPU generator state, one row per rank (collective).
at::Tensor gather_rng_states(const comm::ProcessGroup& pg) {
  at::Tensor state;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  // Bytes as doubles (exact) through one sum all-reduce: each rank fills its row.
  auto rows = torch::zeros({pg.size(), state.numel()}, torch::kFloat64);
  rows[pg.rank()].copy_(state.to(torch::kFloat64));
  comm::all_reduce(pg, rows, comm::ReduceOp::Sum).wait();
  return rows.to(torch::kUInt8);
}

void restore_rng(const CheckpointExtra& extra, const comm::ProcessGroup& pg) {
  auto w = extra.values.find(kWorldKey);
  const int saved_world = w == extra.values.end() ? 0 : std::stoi(w->second);
  const int source = saved_world == pg.size() ? pg.rank() : 0;
  auto it = extra.tensors.find(kRngPrefix + std::to_string(source));
  if (it == extra.tensors.end()) return;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(it->second.contiguous());
}

/// Rank 0 prints each rank's model-state bytes next to unsharded Adam training's 16 B
/// per parameter and the ZeRO accounting for the strategy.
void memory_summary(const TrainerOptions& o, const comm::ProcessGroup& pg, const LoopModel& m) {
  const std::string& name = o.strategy().name();
  const int n = pg.size();
  int group = 0;
  bool bf16 = false;
  if (o.strategy().is_zero()) {
    bf16 = o.strategy().zero().param_dtype() == at::kBFloat16;
  } else {
    const auto fo = o.strategy().resolved_fsdp();
    group = fo.shard_group_size() > 0 ? fo.shard_group_size() : pg.local_world_size();
  }
  const double zero = model_state_estimate(name, m.num_params, n, group, bf16);
  if (pg.rank() == 0) {
    char z[32], u[32];
    format_bytes(zero, z, sizeof z);
    format_bytes(16 * double(m.num_params), u, sizeof u);
    std::fprintf(stderr, "%s memory per rank (%lld parameters; unsharded Adam training holds %s; "
                 "ZeRO estimate for %s with Adam: %s):\n",
                 o.log_name().c_str(), (long long)m.num_params, u, name.c_str(), z);
  }
  print_memory_table(stderr, pg, memory_now(m));
}

}  // namespace

FitResult run_training_loop(const TrainerOptions& o, const comm::ProcessGroup& pg, const LoopModel& model,
                            const LoopData& data, const std::vector<std::shared_ptr<Callback>>& callbacks) {
  TORCH_INTERNAL_ASSERT(model.optimizer && model.module && (model.fsdp != nullptr) != (model.zero != nullptr));
  const int rank = pg.rank(), world = pg.size();
  const bool lead = rank == 0;
  const int64_t k = o.accumulate_grad_batches();
  const char* name = o.log_name().c_str();
  const char* flag = o.resume_name().c_str();
  // The global batch of each step: the user's batch sampler, or the GlobalSampler.
  GlobalSampler sampler(data.train_size, o.global_batch_size(), o.shuffle(), o.seed(),
                        o.last_batch() == LastBatch::kDrop);
  const int64_t steps_per_epoch = data.batch_indices ? data.steps_per_epoch : sampler.steps_per_epoch();
  TORCH_CHECK(steps_per_epoch > 0, name, ": the batch sampler's steps per epoch must be positive, got ",
              steps_per_epoch);
  auto batch_of_step = [&](int64_t step) {
    if (data.batch_indices) return data.batch_indices(step);
    return sampler.batch_indices(step / steps_per_epoch, step % steps_per_epoch);
  };
  const int64_t total_steps = o.max_steps() > 0 ? o.max_steps() : o.max_epochs() * steps_per_epoch;
  torch::optim::Optimizer& opt = *model.optimizer;
  const std::vector<double> initial_lrs = learning_rates(opt);

  // --- resume ---------------------------------------------------------------
  FitResult result;
  std::optional<CheckpointExtra> extra;
  // Both families write the same directory format (docs/checkpoint-format.md), so a
  // ZeRO checkpoint resumes under FSDP and the other way round.
  // The user's check (its own settings, named its way) first, then the data order's.
  auto check_resume = [&](const std::string& dir, const std::map<std::string, std::string>& saved) {
    std::string why = data.resume_check ? data.resume_check(dir, saved) : "";
    return why.empty() ? incompatibility(o, data.train_size, dir, saved) : why;
  };
  auto load_model_checkpoint = [&](const std::string& dir) {
    return model.zero ? load_checkpoint(dir, *model.zero) : load_checkpoint(dir, *model.fsdp, &opt);
  };
  if (o.resume() == "auto") {
    // Rank 0 chooses and tells the others, so that all load the same checkpoint even
    // while the directory changes. A load that fails (a damaged file on any rank) fails
    // on every rank and changes nothing ([Note: atomic load] in src/state/checkpoint.cpp),
    // so every rank passes over it together and tries the next older one.
    int64_t below = std::numeric_limits<int64_t>::max();
    for (;;) {
      auto chosen = torch::full({1}, int64_t(-1), torch::kLong);
      if (lead) {
        auto steps = checkpoint_steps(o.checkpoint_dir());
        for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
          if (*it >= below) continue;
          const std::string dir = checkpoint_path(o.checkpoint_dir(), *it);
          std::vector<std::pair<std::string, std::string>> values;
          std::string why;
          // Every reason names the checkpoint: the loop's and the hook's say which they refused.
          if (read_checkpoint_values(dir, values, why)) why = check_resume(dir, as_map(values));
          else why = std::string(flag) + " " + dir + ": " + why;
          if (why.empty()) {
            chosen.fill_(*it);
            break;
          }
          std::fprintf(stderr, "%s: %s auto: skipped: %s\n", name, flag, why.c_str());
        }
        if (chosen.item<int64_t>() < 0)
          std::fprintf(stderr, "%s: %s auto: no usable checkpoint under %s; starting fresh\n", name, flag,
                       o.checkpoint_dir().c_str());
      }
      comm::broadcast(pg, chosen, 0).wait();
      const int64_t step = chosen.item<int64_t>();
      if (step < 0) break;
      below = step;
      const std::string dir = checkpoint_path(o.checkpoint_dir(), step);
      try {
        extra = load_model_checkpoint(dir);
        result.resumed_from = dir;
        break;
      } catch (const c10::Error& e) {
        const std::string why = e.what_without_backtrace();
        if (why.rfind("fsdp: load_checkpoint('", 0) != 0) throw;
        if (lead) std::fprintf(stderr, "%s: %s auto: skipped: %s\n", name, flag, why.c_str());
      }
    }
  } else if (!o.resume().empty()) {
    extra = load_model_checkpoint(o.resume());
    result.resumed_from = o.resume();
  }
  int64_t first_step = 0;
  if (extra) {
    const std::string why = check_resume(result.resumed_from, extra->values);
    TORCH_CHECK(why.empty(), name, " (rank ", rank, "): resume: ", why);
    first_step = std::stoll(extra->values.at(kStepKey));
    TORCH_CHECK(first_step <= total_steps, name, ": resume ", result.resumed_from, ": the checkpoint is at step ",
                first_step, " but this run has only ", total_steps,
                " steps in all (max_steps / max_epochs count from the run's start); ask for more than ", first_step);
    restore_rng(*extra, pg);
    if (model.scheduler) {
      // The scheduler's position: replay its steps from the initial learning rates,
      // then keep the checkpoint's (equal, unless the schedule changed).
      const std::vector<double> loaded = learning_rates(opt);
      set_learning_rates(opt, initial_lrs);
      for (int64_t s = 0; s < first_step; ++s) model.scheduler->step();
      set_learning_rates(opt, loaded);
    }
    for (auto& cb : callbacks) cb->on_load_checkpoint(*extra);
  }
  result.first_step = first_step;

  const bool append_metrics = first_step > 0 && o.metrics_append_on_resume();
  MetricsLog log(lead ? o.metrics_file() : "", append_metrics, o.metrics_validation_key());
  Progress progress(total_steps, o.progress() && lead, first_step);
  // Rank 0's messages about files it changes: said even without progress reports.
  auto say = [&](const std::string& line) {
    if (!lead) return;
    if (o.progress()) progress.note(line.c_str());
    else std::fprintf(stderr, "%s\n", line.c_str());
  };
  if (append_metrics && log.enabled())
    say(std::string(name) + ": resumed at step " + std::to_string(first_step) + ": appending to the metrics file " +
        o.metrics_file() + " (its lines up to step " + std::to_string(first_step) +
        " stay; metrics_append_on_resume(false) would start it afresh)");

  // --- validation -------------------------------------------------------------
  // Validations and checkpoints between steps: not training time (FitResult::train_seconds).
  double paused_seconds = 0;
  // The validation step over the validation set: global batches of val_batch_size,
  // each cut into contiguous rank parts; per-key means weighted by the parts' counts.
  auto run_validation_step = [&](ValidationMetrics& vm) {
    const int64_t n = data.val_size, per = o.val_batch_size() > 0 ? o.val_batch_size() : o.global_batch_size();
    std::vector<std::string> keys;
    std::vector<double> sums;
    int64_t count = 0;
    for (int64_t begin = 0; begin < n; begin += per) {
      const int64_t size = std::min(per, n - begin);
      auto [lo, hi] = contiguous_part(size, world, rank);
      std::vector<int64_t> idx;
      for (int64_t i = begin + lo; i < begin + hi; ++i) idx.push_back(i);
      const int64_t mine = int64_t(idx.size());
      if (mine == 0) idx.push_back(begin);  // forward is collective: run, weigh 0
      std::map<std::string, double> values;
      try {
        values = data.validation_step(idx);
      } catch (c10::Error& e) {
        TORCH_RETHROW(e, name, " (rank ", rank, "): validation after step ", vm.step, ", samples ", begin, "..",
                      begin + size - 1, " of the validation set");
      }
      if (keys.empty()) {
        for (auto& kv : values) keys.push_back(kv.first);
        sums.assign(keys.size(), 0.0);
      }
      TORCH_CHECK(values.size() == keys.size(), name, " (rank ", rank,
                  "): the validation step returned different keys in different batches; return the same keys");
      size_t i = 0;
      for (auto& [key, v] : values) {
        TORCH_CHECK(key == keys[i], name, " (rank ", rank, "): the validation step returned key '", key,
                    "' where an earlier batch had '", keys[i], "'; return the same keys in every batch");
        sums[i++] += v * double(mine);
      }
      count += mine;
    }
    sums.push_back(double(count));
    auto t = torch::tensor(sums, torch::kFloat64);
    comm::all_reduce(pg, t, comm::ReduceOp::Sum).wait();
    auto acc = t.accessor<double, 1>();
    vm.samples = int64_t(acc[int64_t(keys.size())] + 0.5);
    for (size_t i = 0; i < keys.size(); ++i) vm.values[keys[i]] = acc[int64_t(i)] / double(std::max<int64_t>(vm.samples, 1));
  };
  const bool has_validation = bool(data.validation_loop) || bool(data.validation_step);
  auto validate = [&](int64_t step) {
    if (!has_validation) return;
    const auto t0 = Clock::now();
    ValidationMetrics vm;
    vm.step = step;
    torch::NoGradGuard no_grad;
    model.module->eval();
    if (data.validation_loop) {
      vm = data.validation_loop(step);
      vm.step = step;
    } else {
      run_validation_step(vm);
    }
    model.module->train();
    log.write_validation(vm);
    if (lead && o.progress()) {
      std::string line = vm.note;
      if (line.empty()) {
        line = "validation after step " + std::to_string(step) + ":";
        char buf[64];
        for (auto& [key, v] : vm.values) {
          std::snprintf(buf, sizeof buf, " %s %.4f", key.c_str(), v);
          line += buf;
        }
      }
      progress.note(line.c_str());
    }
    for (auto& cb : callbacks) cb->on_validation_end(vm);
    result.validation = vm.values;
    paused_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  };

  // --- checkpoints ------------------------------------------------------------
  auto checkpoint = [&](int64_t step) {
    if (o.checkpoint_dir().empty()) return;
    const auto t0 = Clock::now();
    CheckpointExtra e;
    e.values[kMarkerKey] = "1";
    e.values[kStepKey] = std::to_string(step);
    e.values[kWorldKey] = std::to_string(world);
    for (auto& [key, value] : fixed_values(o, data.train_size)) e.values[key] = value;
    const at::Tensor rng = gather_rng_states(pg);
    for (int r = 0; r < world; ++r) e.tensors[kRngPrefix + std::to_string(r)] = rng[r].clone();
    for (auto& cb : callbacks) cb->on_save_checkpoint(e);
    const std::string dir = checkpoint_path(o.checkpoint_dir(), step);
    if (model.zero) save_checkpoint(dir, *model.zero, e);
    else save_checkpoint(dir, *model.fsdp, &opt, e);
    if (lead && o.keep_checkpoints() > 0) {
      const PruneResult pruned = prune_checkpoints(o.checkpoint_dir(), o.keep_checkpoints());
      for (const std::string& old : pruned.deleted)
        say(std::string(name) + ": deleted checkpoint " + old + ": keep_checkpoints " +
            std::to_string(o.keep_checkpoints()) + " keeps only the newest (0 keeps all)");
      if (!pruned.failed.empty())
        std::fprintf(stderr, "%s: warning: keep_checkpoints could not delete %s\n", name, pruned.failed.c_str());
    }
    for (auto& cb : callbacks) cb->on_checkpoint(dir, step);
    paused_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  };

  // --- training ---------------------------------------------------------------
  TrainStart start;
  start.rank = rank;
  start.world_size = world;
  start.first_step = first_step;
  start.total_steps = total_steps;
  start.resumed_from = result.resumed_from;
  for (auto& cb : callbacks) cb->on_train_start(start);
  // A resumed run does not rewrite the checkpoint it started from.
  if (o.checkpoint_at_start() && first_step == 0) checkpoint(0);
  model.module->train();
  bool want_memory = lead && !o.metrics_file().empty();
  for (auto& cb : callbacks) want_memory = want_memory || cb->needs_memory();
  StepMetrics last;
  int64_t interval_samples = 0;
  auto t_interval = Clock::now();
  StepLossReduction losses(pg);
  // A step's metrics once its global loss is known: log, callbacks, progress.
  auto emit = [&](const StepMetrics& sm) {
    result.losses.push_back(sm.loss);
    log.write_step(sm);
    for (auto& cb : callbacks) cb->on_step_end(sm);
    last = sm;
    interval_samples += sm.samples;
    if (sm.step % o.log_every_n_steps() == 0 || sm.step == total_steps) {
      const double dt = std::chrono::duration<double>(Clock::now() - t_interval).count();
      progress.report(sm.step, sm.loss, double(interval_samples) / std::max(dt, 1e-9));
      t_interval = Clock::now();
      interval_samples = 0;
    }
  };
  int64_t last_validated = -1;
  paused_seconds = 0;
  const auto t_train = Clock::now();
  for (int64_t step = first_step; step < total_steps; ++step) {
    const auto t_step = Clock::now();
    const int64_t epoch = step / steps_per_epoch;
    const std::vector<int64_t> batch = batch_of_step(step);
    const int64_t m = int64_t(batch.size());
    TORCH_CHECK(m > 0, name, ": the batch sampler gave step ", step, " no samples; give every step at least one");
    const double lr = opt.param_groups().at(0).options().get_lr();
    zero_grad(model);
    // Micro-batches with samples (all of them unless the batch has fewer than k).
    std::vector<std::pair<int64_t, int64_t>> micro;
    for (int64_t j = 0; j < k; ++j) {
      auto part = contiguous_part(m, k, j);
      if (part.second > part.first) micro.push_back(part);
    }
    double loss_sum = 0;   // sum over this rank's samples of the per-sample loss
    double means_sum = 0;  // sum over this rank's micro-batches of their mean losses
    for (size_t j = 0; j < micro.size(); ++j) {
      const auto [a, b] = micro[j];
      const auto [lo, hi] = contiguous_part(b - a, world, rank);
      std::vector<int64_t> idx(batch.begin() + a + lo, batch.begin() + a + hi);
      const int64_t mine = int64_t(idx.size());
      if (mine == 0) idx.push_back(batch[size_t(a)]);  // forward/backward are collective: run, weigh 0
      // Reductions average over ranks; a rank's mean of `mine` samples enters the
      // step's mean over m samples with weight mine/m, hence mine*world/m here
      // (= 1/k for k equal micro-batches).
      const double weight = double(mine) * double(world) / double(m);
      std::unique_ptr<FullyShardedBase::NoSyncGuard> no_sync;
      if (model.fsdp && j + 1 < micro.size()) no_sync = model.fsdp->no_sync();
      at::Tensor loss;
      try {
        loss = data.train_step(idx);
      } catch (c10::Error& e) {
        // Where it happened, which the batch function and the user's step do not know.
        TORCH_RETHROW(e, name, " (rank ", rank, "): training step ", step + 1, " of ", total_steps, ", micro-batch ",
                      j + 1, " of ", micro.size());
      }
      TORCH_CHECK(loss.defined() && loss.numel() == 1 && loss.requires_grad(), name, " (rank ", rank,
                  "): the training step must return the scalar mean loss of its batch, attached to the graph; got ",
                  loss.defined() ? loss.sizes() : at::IntArrayRef{});
      (weight == 1.0 ? loss : loss * weight).backward();
      if (mine > 0) {
        const double mean = loss.item<double>();
        loss_sum += mean * double(mine);
        means_sum += mean;
      }
    }
    if (model.fsdp && o.gradient_clip_val() > 0) model.fsdp->clip_grad_norm_(o.gradient_clip_val());
    opt.step();  // zero1/zero2 clip inside step() (ZeroOptions::clip_grad_norm)
    if (model.scheduler) model.scheduler->step();
    for (auto& cb : callbacks) cb->on_optimizer_step(step + 1);
    StepMetrics sm;
    sm.step = step + 1;
    sm.epoch = epoch;
    sm.samples = m;
    sm.lr = lr;
    sm.samples_per_s = double(m) / std::max(1e-9, std::chrono::duration<double>(Clock::now() - t_step).count());
    if (want_memory) sm.memory = memory_now(model);
    // The global loss arrives after the next step's optimizer step unless something
    // between the steps needs it now ([Note: overlapped step loss]).
    // [Note: step loss] With equal parts (m divisible by k x world) the step's loss is
    // the plain mean of the parts' means: each rank's mean of its micro-batch means,
    // then the mean over ranks (ReduceOp::Avg's sum / world). That is the mean over
    // the global batch, rounded as data-parallel PyTorch (and fsdp-train's tests'
    // reference) computes it; with k = 1 a rank's value is its loss as returned.
    // Unequal parts (a short last batch) weigh each rank's samples by count instead.
    if (m % (k * world) == 0) losses.start(sm, means_sum / double(k), double(world));
    else losses.start(sm, loss_sum, double(m));
    const bool save_now =
        sm.step == total_steps || (o.checkpoint_interval() > 0 && sm.step % o.checkpoint_interval() == 0);
    const bool validate_now = o.val_check_interval() > 0 && sm.step % o.val_check_interval() == 0;
    const size_t may_stay = o.overlap_step_metrics() && !save_now && !validate_now ? 1 : 0;
    while (losses.in_flight() > may_stay) emit(losses.finish_oldest());
    if (save_now) checkpoint(sm.step);
    if (validate_now) {
      validate(sm.step);
      last_validated = sm.step;
      // The next progress report's rate counts training only (the steps reported so far
      // are all emitted: validate_now drained them).
      t_interval = Clock::now();
      interval_samples = 0;
    }
  }
  while (losses.in_flight() > 0) emit(losses.finish_oldest());
  result.train_seconds = std::chrono::duration<double>(Clock::now() - t_train).count() - paused_seconds;
  progress.finish();
  if (last_validated != total_steps) validate(total_steps);
  result.last_step = total_steps;
  if (o.memory_summary()) memory_summary(o, pg, model);
  if (result.losses.empty()) last.step = total_steps;
  for (auto& cb : callbacks) cb->on_train_end(last);
  return result;
}

}  // namespace fsdp::trainer::detail
