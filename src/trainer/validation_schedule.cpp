#include "validation_schedule.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/trainer/global_sampler.h"

namespace fsdp::trainer::detail {

namespace {

/// Running per-key sums of a validation step's means, each weighted by its part's
/// samples; every batch must return the keys of the first.
struct WeightedSums {
  std::vector<std::string> keys;
  std::vector<double> sums;

  void add(const LoopContext& ctx, const std::map<std::string, double>& values, int64_t weight) {
    if (keys.empty()) {
      for (auto& kv : values) keys.push_back(kv.first);
      sums.assign(keys.size(), 0.0);
    }
    TORCH_CHECK(values.size() == keys.size(), ctx.program(), " (rank ", ctx.rank(),
                "): the validation step returned different keys in different batches; return the same keys");
    size_t i = 0;
    for (auto& [key, v] : values) {
      TORCH_CHECK(key == keys[i], ctx.program(), " (rank ", ctx.rank(), "): the validation step returned key '", key,
                  "' where an earlier batch had '", keys[i], "'; return the same keys in every batch");
      sums[i++] += v * double(weight);
    }
  }
};

}  // namespace

ValidationSchedule::ValidationSchedule(const LoopContext& ctx, MetricsLog& log, Progress& progress,
                                       FitResult& result)
    : ctx_(ctx), log_(log), progress_(progress), result_(result) {}

bool ValidationSchedule::due(int64_t step) const {
  const int64_t every = ctx_.options.val_check_interval();
  return every > 0 && step % every == 0;
}

void ValidationSchedule::run(int64_t step) {
  last_validated_ = step;
  if (!ctx_.data.validation_loop && !ctx_.data.validation_step) return;
  const auto t0 = LoopClock::now();
  torch::NoGradGuard no_grad;  // the hooks below too, as the validation itself
  const ValidationMetrics vm = validate(step);
  log_.write_validation(vm);
  announce(vm);
  for (auto& cb : ctx_.callbacks) cb->on_validation_end(vm);
  result_.validation = vm.values;
  seconds_ += std::chrono::duration<double>(LoopClock::now() - t0).count();
}

void ValidationSchedule::finish(int64_t last_step) {
  if (last_validated_ != last_step) run(last_step);
}

ValidationMetrics ValidationSchedule::validate(int64_t step) {
  ctx_.model.module->eval();
  ValidationMetrics vm = ctx_.data.validation_loop ? ctx_.data.validation_loop(step) : mean_over_validation_set();
  vm.step = step;
  ctx_.model.module->train();
  return vm;
}

/// The validation step over the whole validation set (collective).
ValidationMetrics ValidationSchedule::mean_over_validation_set() {
  const TrainerOptions& o = ctx_.options;
  const int64_t n = ctx_.data.val_size, per = o.val_batch_size() > 0 ? o.val_batch_size() : o.global_batch_size();
  WeightedSums acc;
  int64_t count = 0;
  for (int64_t begin = 0; begin < n; begin += per) {
    auto [lo, hi] = contiguous_part(std::min(per, n - begin), ctx_.world(), ctx_.rank());
    std::vector<int64_t> idx;
    for (int64_t i = begin + lo; i < begin + hi; ++i) idx.push_back(i);
    const int64_t mine = int64_t(idx.size());
    if (mine == 0) idx.push_back(begin);  // forward is collective: run, weigh 0
    std::map<std::string, double> values;
    try {
      values = ctx_.data.validation_step(idx);
    } catch (c10::Error& e) {
      TORCH_RETHROW(e, ctx_.program(), " (rank ", ctx_.rank(), "): validation, samples ", begin, "..",
                    begin + std::min(per, n - begin) - 1, " of the validation set");
    }
    acc.add(ctx_, values, mine);
    count += mine;
  }
  std::vector<double> sums = acc.sums;
  sums.push_back(double(count));
  auto t = torch::tensor(sums, torch::kFloat64);
  comm::all_reduce(ctx_.pg, t, comm::ReduceOp::kSum, {comm::Phase::kTrainer, "validation"}).wait();
  auto a = t.accessor<double, 1>();
  ValidationMetrics vm;
  vm.samples = int64_t(a[int64_t(acc.keys.size())] + 0.5);
  for (size_t i = 0; i < acc.keys.size(); ++i)
    vm.values[acc.keys[i]] = a[int64_t(i)] / double(std::max<int64_t>(vm.samples, 1));
  return vm;
}

/// Rank 0's progress note: the validation loop's own, or the loop's "validation after
/// step S: <key> <value> ...".
void ValidationSchedule::announce(const ValidationMetrics& vm) {
  if (!ctx_.lead() || !ctx_.options.progress()) return;
  std::string line = vm.note;
  if (line.empty()) {
    line = "validation after step " + std::to_string(vm.step) + ":";
    char buf[64];
    for (auto& [key, v] : vm.values) {
      std::snprintf(buf, sizeof buf, " %s %.4f", key.c_str(), v);
      line += buf;
    }
  }
  progress_.note(line.c_str());
}

}  // namespace fsdp::trainer::detail
