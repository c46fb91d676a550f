#include "fsdp/trainer/step_loss_reduction.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

namespace fsdp::trainer {

StepLossReduction::~StepLossReduction() {
  for (auto& p : pending_) {
    try {
      p.handle.wait();
    } catch (...) {
      // The group failed; the error that matters is the one already propagating, or
      // the next collective's.
    }
  }
}

void StepLossReduction::start(const StepMetrics& metrics, double local, double divisor) {
  TORCH_CHECK(divisor > 0, "fsdp::trainer::StepLossReduction: divisor must be > 0, got ", divisor);
  Pending p;
  p.metrics = metrics;
  p.value = torch::full({1}, local, torch::kFloat64);
  p.divisor = divisor;
  p.handle = comm::all_reduce(group_, p.value, comm::ReduceOp::kSum, {comm::Phase::kTrainer, "step loss"});
  pending_.push_back(std::move(p));
}

StepMetrics StepLossReduction::finish_oldest() {
  TORCH_CHECK(!pending_.empty(), "fsdp::trainer::StepLossReduction: finish_oldest() with no step started");
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  p.handle.wait();
  p.metrics.loss = p.value.item<double>() / p.divisor;
  return p.metrics;
}

}  // namespace fsdp::trainer
