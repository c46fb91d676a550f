#include "in_backward_steps.h"

#include <utility>

#include "host_step_queue.h"

namespace fsdp::engine {

InBackwardSteps::InBackwardSteps(bool host_thread, const c10::Device& device) {
  if (host_thread) host_steps_ = std::make_unique<HostStepQueue>(device);
}

InBackwardSteps::~InBackwardSteps() = default;

void InBackwardSteps::run(std::function<void()> step, bool offloaded) {
  if (host_steps_ && offloaded) {
    host_steps_->post(std::move(step));
    return;
  }
  drain();
  step();
}

void InBackwardSteps::drain() {
  if (host_steps_) host_steps_->drain();
}

}  // namespace fsdp::engine
