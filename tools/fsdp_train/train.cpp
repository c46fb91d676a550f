#include "train.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include <torch/torch.h>

#include "estimate.h"
#include "fsdp/dist/collectives.h"
#include "fsdp/dist/process_group.h"
#include "fsdp/fsdp/fully_sharded.h"
#include "fsdp/optim/cpu_adam.h"
#include "metrics.h"
#include "mnist.h"
#include "progress.h"

namespace fsdp::train {

namespace {

namespace dist = fsdp::dist;
using Clock = std::chrono::steady_clock;

constexpr int64_t kPixels = 28 * 28;
constexpr int64_t kEvalBatch = 1000;

// [Note: batches]
//   A *global batch* of B samples is one optimizer step; rank r of N takes the contiguous
//   *rank slice* i in [r*B/N, (r+1)*B/N). Sample i of step s is, within epoch e = s / S
//   (S = floor(60000/B) steps per epoch), perm_e[(s mod S)*B + i] with shuffling, or
//   (s*B + i) mod 60000 without (which then wraps across epochs). perm_e comes from a
//   std::mt19937_64 seeded with (seed, e) alone, so every rank draws the same order and
//   a run is reproducible. The loss of a step is the mean over the global batch: the
//   average of the rank slices' mean losses (all slices have B/N samples).
class Sampler {
 public:
  Sampler(int64_t dataset_size, int64_t batch, bool shuffle, uint64_t seed)
      : n_(dataset_size), batch_(batch), shuffle_(shuffle), seed_(seed), steps_per_epoch_(dataset_size / batch) {}

  int64_t steps_per_epoch() const { return steps_per_epoch_; }

  /// Global indices [begin, end) of step s (0-based).
  std::vector<int64_t> indices(int64_t s, int64_t begin, int64_t end) {
    std::vector<int64_t> out;
    out.reserve(size_t(end - begin));
    if (!shuffle_) {
      for (int64_t i = begin; i < end; ++i) out.push_back((s * batch_ + i) % n_);
      return out;
    }
    int64_t epoch = s / steps_per_epoch_;
    if (epoch != perm_epoch_) make_perm(epoch);
    int64_t base = (s % steps_per_epoch_) * batch_;
    for (int64_t i = begin; i < end; ++i) out.push_back(perm_[size_t(base + i)]);
    return out;
  }

 private:
  void make_perm(int64_t epoch) {
    std::seed_seq seq{uint64_t(seed_), uint64_t(seed_ >> 32), uint64_t(epoch)};
    std::mt19937_64 rng(seq);
    perm_.resize(size_t(n_));
    std::iota(perm_.begin(), perm_.end(), 0);
    // Fisher-Yates with rng() % k rather than std::shuffle/uniform_int_distribution, whose
    // outputs the standard leaves to the library: the order must not depend on it.
    for (int64_t i = n_ - 1; i > 0; --i) std::swap(perm_[size_t(i)], perm_[size_t(rng() % uint64_t(i + 1))]);
    perm_epoch_ = epoch;
  }

  int64_t n_, batch_;
  bool shuffle_;
  uint64_t seed_;
  int64_t steps_per_epoch_;
  int64_t perm_epoch_ = -1;
  std::vector<int64_t> perm_;
};

/// Pixels as uint8 [count, 784] and labels as int64 [count]; batches are converted to
/// float in [0,1] on the fly (a float copy of the train set would be 188 MB per rank).
struct TensorSplit {
  torch::Tensor pixels, labels;
};

TensorSplit to_tensors(Split s) {
  auto count = s.images.count;
  auto px = torch::from_blob(s.images.pixels.data(), {count, s.images.rows * s.images.cols}, torch::kUInt8).clone();
  auto lb = torch::from_blob(s.labels.data(), {count}, torch::kUInt8).to(torch::kInt64);
  return {px, lb};
}

torch::Tensor batch_inputs(const TensorSplit& d, const torch::Tensor& idx) {
  return d.pixels.index_select(0, idx).to(torch::kFloat32).div_(255.0);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o,
                                                        std::vector<torch::Tensor> params) {
  const double lr = o.effective_lr();
  if (o.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(lr).momentum(o.momentum).weight_decay(o.weight_decay));
  if (o.optimizer == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr).weight_decay(o.weight_decay));
  if (o.optimizer == "adamw")
    return std::make_unique<torch::optim::AdamW>(params,
                                                 torch::optim::AdamWOptions(lr).weight_decay(o.weight_decay));
  TORCH_CHECK(o.optimizer == "cpu_adam", "unknown optimizer '", o.optimizer, "' (parser should have caught it)");
  return std::make_unique<fsdp::optim::CPUAdam>(params, fsdp::optim::CPUAdamOptions(lr).weight_decay(o.weight_decay));
}

int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; }

/// Sum of the optimizer's state tensors on this rank (they live on the parameter shards).
int64_t optimizer_state_bytes(torch::optim::Optimizer& opt) {
  int64_t total = 0;
  for (auto& kv : opt.state()) {
    auto* s = kv.second.get();
    if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(s))
      total += bytes_of(a->exp_avg()) + bytes_of(a->exp_avg_sq()) + bytes_of(a->max_exp_avg_sq());
    else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(s))
      total += bytes_of(w->exp_avg()) + bytes_of(w->exp_avg_sq()) + bytes_of(w->max_exp_avg_sq());
    else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(s))
      total += bytes_of(g->momentum_buffer());
  }
  return total;
}

struct EvalResult {
  double loss = 0, accuracy = 0;
  int64_t correct = 0, total = 0;
};

/// Each rank evaluates its contiguous slice of the test set; sums are all-reduced.
/// Every rank runs the same number of forwards (FSDP's forward is collective), the
/// last ones possibly on empty batches when the slices differ in size.
template <typename Model>
EvalResult evaluate(Model& model, const dist::ProcessGroup& pg, const TensorSplit& test) {
  torch::NoGradGuard no_grad;
  const int64_t n = test.labels.size(0), r = pg.rank(), w = pg.size();
  const int64_t begin = r * n / w, end = (r + 1) * n / w;
  const int64_t max_slice = (n + w - 1) / w;
  const int64_t batches = (max_slice + kEvalBatch - 1) / kEvalBatch;
  double loss_sum = 0, correct = 0;
  for (int64_t b = 0; b < batches; ++b) {
    int64_t lo = std::min(end, begin + b * kEvalBatch), hi = std::min(end, lo + kEvalBatch);
    auto x = test.pixels.slice(0, lo, hi).to(torch::kFloat32).div_(255.0);
    auto y = test.labels.slice(0, lo, hi);
    torch::Tensor logits = model->forward(x);
    if (hi > lo) {
      loss_sum += torch::nn::functional::cross_entropy(
                      logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                      .item<double>();
      correct += logits.argmax(1).eq(y).sum().item<double>();
    }
  }
  auto sums = torch::tensor({loss_sum, correct}, torch::kFloat64);
  dist::all_reduce(pg, sums, dist::ReduceOp::Sum).wait();
  EvalResult e;
  e.total = n;
  e.correct = int64_t(sums[1].item<double>() + 0.5);
  e.loss = sums[0].item<double>() / double(n);
  e.accuracy = double(e.correct) / double(n);
  return e;
}

void print_summary(const TrainOptions& o, const dist::ProcessGroup& pg, const EvalResult& e,
                   int64_t steps, double train_seconds, int64_t num_params,
                   const std::vector<std::vector<double>>& mem /* [rank][4] */) {
  const int n = pg.size();
  std::printf("== fsdp-train summary: %s, %s, %d ranks x %d threads, %s (lr %g), global batch %lld ==\n",
              o.model.c_str(), o.strategy.c_str(), n, o.threads, o.optimizer.c_str(), o.effective_lr(),
              (long long)o.batch_size);
  std::printf("test accuracy: %.2f%% (%lld/%lld), test loss %.4f\n", 100.0 * e.accuracy, (long long)e.correct,
              (long long)e.total, e.loss);
  std::printf("throughput: %.0f samples/s (%lld steps, %lld samples in %.1f s)\n",
              double(steps * o.batch_size) / train_seconds, (long long)steps, (long long)(steps * o.batch_size),
              train_seconds);
  std::printf("memory per rank (%lld parameters; unsharded Adam training holds 16 B/param = %lld B):\n",
              (long long)num_params, (long long)(16 * num_params));
  std::printf("  %-6s %14s %14s %14s %16s %14s %16s\n", "rank", "params", "grads", "optim state", "peak unsharded",
              "model state", "unsharded Adam");
  for (int r = 0; r < n; ++r) {
    char a[32], b[32], c[32], d[32], t[32], u[32];
    format_bytes(mem[r][0], a, sizeof a);
    format_bytes(mem[r][1], b, sizeof b);
    format_bytes(mem[r][2], c, sizeof c);
    format_bytes(mem[r][3], d, sizeof d);
    format_bytes(mem[r][0] + mem[r][1] + mem[r][2], t, sizeof t);
    format_bytes(16.0 * double(num_params), u, sizeof u);
    std::printf("  %-6d %14s %14s %14s %16s %14s %16s\n", r, a, b, c, d, t, u);
  }
  std::fflush(stdout);
}

}  // namespace

int run_rank(const TrainOptions& o) {
  at::set_num_threads(o.threads);
  auto pg = dist::init_process_group();
  const int rank = pg.rank(), world = pg.size();
  const bool lead = rank == 0;

  // Checked on every rank, so each exits non-zero on its own instead of waiting for peers.
  std::string err = check_world_size(o, world);
  if (!err.empty()) {
    std::fprintf(stderr, "fsdp-train: error (rank %d): %s\n", rank, err.c_str());
    return 2;
  }

  TensorSplit train_set = to_tensors(load_split(o.data_dir, "train"));
  TensorSplit test_set = to_tensors(load_split(o.data_dir, "t10k"));

  // Same seed on every rank before the model is built: identical initial weights
  // without a broadcast.
  torch::manual_seed(o.seed);
  const int64_t h = o.hidden;
  torch::nn::Sequential mlp(torch::nn::Linear(kPixels, h), torch::nn::ReLU(), torch::nn::Linear(h, h),
                            torch::nn::ReLU(), torch::nn::Linear(h, 10));
  int64_t num_params = 0;
  for (auto& p : mlp->parameters()) num_params += p.numel();

  auto model = fsdp::FullyShardedDataParallel(
      mlp, pg,
      fsdp::Options()
          .sharding_strategy(fsdp::parse_sharding_strategy(o.strategy))
          .auto_wrap_policy(fsdp::size_based_policy(o.min_num_params)));
  auto opt = make_optimizer(o, model->parameters());

  const int64_t n_train = train_set.labels.size(0);
  Sampler sampler(n_train, o.batch_size, o.shuffle, o.seed);
  const int64_t total_steps = o.steps ? *o.steps : (o.epochs ? *o.epochs : kDefaultEpochs) * sampler.steps_per_epoch();
  const int64_t local_batch = o.batch_size / world;
  const int64_t begin = rank * local_batch, end = begin + local_batch;

  MetricsWriter metrics(lead ? o.metrics_path : "");
  // Every rank must take the same decision: --metrics is the same flag everywhere.
  const bool loss_every_step = !o.metrics_path.empty();
  Progress progress(total_steps, o.log_every, lead);
  if (lead) {
    std::fprintf(stderr,
                 "fsdp-train: %s (%lld params, %zu units), %s, %d ranks, %s lr %g, global batch %lld, %lld steps\n",
                 o.model.c_str(), (long long)num_params, model->unit_paths().size(), o.strategy.c_str(), world,
                 o.optimizer.c_str(), o.effective_lr(), (long long)o.batch_size, (long long)total_steps);
  }

  auto eval_and_report = [&](int64_t step) {
    EvalResult e = evaluate(model, pg, test_set);
    if (lead) {
      char line[160];
      std::snprintf(line, sizeof line, "eval @ step %lld: loss %.4f  accuracy %.2f%%", (long long)step, e.loss,
                    100.0 * e.accuracy);
      progress.note(line);
      metrics.write_eval(step, e.loss, e.accuracy);
    }
    return e;
  };

  const auto t_start = Clock::now();
  auto t_interval = t_start;
  int64_t interval_steps = 0;
  double eval_seconds = 0;
  int64_t optim_bytes = -1;
  for (int64_t s = 0; s < total_steps; ++s) {
    const auto t_step = Clock::now();
    auto idx = torch::tensor(sampler.indices(s, begin, end), torch::kInt64);
    auto x = batch_inputs(train_set, idx);
    auto y = train_set.labels.index_select(0, idx);

    opt->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    opt->step();
    ++interval_steps;

    const int64_t step = s + 1;
    const bool log_now = step % o.log_every == 0 || step == total_steps;
    if (loss_every_step || log_now) {
      auto global = loss.detach().to(torch::kFloat64).reshape({1});
      dist::all_reduce(pg, global, dist::ReduceOp::Avg).wait();
      const double loss_value = global.item<double>();
      const auto now = Clock::now();
      if (lead && metrics.enabled()) {
        if (optim_bytes < 0) optim_bytes = optimizer_state_bytes(*opt);  // fixed after the first step
        auto ms = model->memory_stats();
        MemorySample m{ms.param_shard_bytes, ms.grad_shard_bytes, optim_bytes, ms.unsharded_peak_bytes,
                       current_rss_bytes()};
        double sps = double(o.batch_size) / std::chrono::duration<double>(now - t_step).count();
        metrics.write_step(step, loss_value, o.effective_lr(), sps, m);
      }
      if (log_now) {
        double dt = std::chrono::duration<double>(now - t_interval).count();
        progress.report(step, loss_value, double(interval_steps * o.batch_size) / dt);
        t_interval = now;
        interval_steps = 0;
      }
    }
    if (o.eval_every > 0 && step % o.eval_every == 0 && step != total_steps) {
      const auto t0 = Clock::now();
      eval_and_report(step);
      eval_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      t_interval = Clock::now();
      interval_steps = 0;
    }
  }
  const double train_seconds = std::chrono::duration<double>(Clock::now() - t_start).count() - eval_seconds;
  progress.finish();

  EvalResult final_eval = eval_and_report(total_steps);

  // Per-rank memory to rank 0: each rank fills its own row, a sum all-reduce assembles.
  auto ms = model->memory_stats();
  auto mem = torch::zeros({world, 4}, torch::kFloat64);
  mem[rank][0] = double(ms.param_shard_bytes);
  mem[rank][1] = double(ms.grad_shard_bytes);
  mem[rank][2] = double(optimizer_state_bytes(*opt));
  mem[rank][3] = double(ms.unsharded_peak_bytes);
  dist::all_reduce(pg, mem, dist::ReduceOp::Sum).wait();
  if (lead) {
    std::vector<std::vector<double>> rows(size_t(world), std::vector<double>(4));
    auto acc = mem.accessor<double, 2>();
    for (int r = 0; r < world; ++r)
      for (int c = 0; c < 4; ++c) rows[size_t(r)][size_t(c)] = acc[r][c];
    print_summary(o, pg, final_eval, total_steps, train_seconds, num_params, rows);
  }
  dist::barrier(pg);
  return 0;
}

}  // namespace fsdp::train
