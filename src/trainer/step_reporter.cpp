#include "step_reporter.h"

#include <algorithm>

namespace fsdp::trainer::detail {

StepReporter::StepReporter(const LoopContext& ctx, MetricsLog& log, Progress& progress, int64_t total_steps,
                           FitResult& result)
    : ctx_(ctx), log_(log), progress_(progress), total_steps_(total_steps), result_(result), losses_(ctx.pg) {}

void StepReporter::add(const RanStep& ran) { losses_.start(ran.metrics, ran.local_loss, ran.loss_divisor); }

void StepReporter::report_until(size_t may_stay) {
  while (losses_.in_flight() > may_stay) report(losses_.finish_oldest());
}

void StepReporter::restart_interval() {
  interval_start_ = LoopClock::now();
  interval_samples_ = 0;
}

StepMetrics StepReporter::last() const {
  StepMetrics last = last_;
  if (result_.losses.empty()) last.step = total_steps_;
  return last;
}

void StepReporter::report(StepMetrics sm) {
  if (checkpoints_reported_ < result_.checkpoints.size()) sm.checkpoint = result_.checkpoints[checkpoints_reported_++];
  result_.losses.push_back(sm.loss);
  log_.write_step(sm);
  for (auto& cb : ctx_.callbacks) cb->on_step_end(sm);
  last_ = sm;
  interval_samples_ += sm.samples;
  if (sm.step % ctx_.options.log_every_n_steps() == 0 || sm.step == total_steps_) {
    const double dt = std::chrono::duration<double>(LoopClock::now() - interval_start_).count();
    progress_.report(sm.step, sm.loss, double(interval_samples_) / std::max(dt, 1e-9));
    restart_interval();
  }
}

}  // namespace fsdp::trainer::detail
