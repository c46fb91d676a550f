#pragma once
// zero_grad(set_to_none) of torch::optim::Optimizer (whose libtorch 1.13 version has no
// set_to_none): drops (set_to_none) or zeroes in place the gradients of every parameter
// of `groups`.
#include <vector>

#include <torch/optim/optimizer.h>

namespace fsdp::optim::detail {

inline void clear_grads(std::vector<torch::optim::OptimizerParamGroup>& groups, bool set_to_none) {
  for (auto& group : groups) {
    for (auto& p : group.params()) {
      at::Tensor& g = p.mutable_grad();
      if (!g.defined()) continue;
      if (set_to_none) {
        g.reset();
      } else {
        g.detach_();
        g.zero_();
      }
    }
  }
}

}  // namespace fsdp::optim::detail
