#include "autograd/rng_fork.h"

#include <mutex>

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>

namespace fsdp::autograd::detail {

namespace {

std::vector<at::Generator> generators_of(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  std::vector<c10::DeviceIndex> cuda;
  for (const auto& t : inputs) {
    if (!t.defined() || !t.is_cuda()) continue;
    const c10::DeviceIndex d = t.device().index();
    if (std::find(cuda.begin(), cuda.end(), d) != cuda.end()) continue;
    cuda.push_back(d);
    gens.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, d)));
  }
  return gens;
}

}  // namespace

RngStates RngStates::capture(const std::vector<at::Tensor>& inputs) {
  RngStates s;
  for (auto& g : generators_of(inputs)) {
    std::lock_guard<std::mutex> lock(g.mutex());
    s.states_.push_back({g, g.get_state()});
  }
  return s;
}

RngStates RngStates::install() const {
  RngStates replaced;
  for (const auto& one : states_) {
    at::Generator g = one.generator;
    std::lock_guard<std::mutex> lock(g.mutex());
    replaced.states_.push_back({g, g.get_state()});
    g.set_state(one.state);
  }
  return replaced;
}

}  // namespace fsdp::autograd::detail
