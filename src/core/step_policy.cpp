#include "step_policy.h"

#include "phase_span.h"
#include "unit.h"
#include "unit_placement.h"

namespace fsdp::core::detail {

StepPolicy::StepPolicy(const ResolvedOptions& options)
    : optimizer_in_backward_(options.optimizer_in_backward), gpu_margin_mem_ratio_(options.gpu_margin_mem_ratio) {}

void StepPolicy::check_registered(int rank) const {
  TORCH_CHECK(!optimizer_in_backward_ || backward_optimizer_, "fsdp (rank ", rank,
              "): Options::optimizer_in_backward is set, but no optimizer was registered to step in backward; call "
              "model->register_optimizer_in_backward(optimizer) before the first training forward");
}

void StepPolicy::step(Unit& unit, Tracer* tracer) {
  PhaseSpan stepping(tracer, "step", unit.label());
  backward_optimizer_->step(unit);
}

void StepPolicy::wait_for_host_steps(Tracer& tracer) {
  if (!backward_optimizer_) return;
  // With offload the device has no work left while this waits: the trace shows how long the
  // step's device side waits for the host.
  Tracer::Mark wait = backward_optimizer_->on_host_thread() ? tracer.begin() : Tracer::Mark{};
  backward_optimizer_->drain();
  tracer.end("host_steps", Tracer::kCompute, wait);
}

void StepPolicy::place_after_warmup(const std::vector<Unit*>& reduce_order) {
  if (placed_ || gpu_margin_mem_ratio_ == 0 || !steps_in_backward()) return;
  placed_ = true;
  placed_on_device_ = place_units_on_device(reduce_order, backward_optimizer_->optimizer(), gpu_margin_mem_ratio_);
}

}  // namespace fsdp::core::detail
