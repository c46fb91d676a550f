#pragma once
// A handle that keeps a leaf's AccumulateGrad node (and the post hooks registered on it)
// alive: whatever torch::autograd::impl::grad_accumulator returns, std::shared_ptr<Node> in
// libtorch 2.11, c10::intrusive_ptr<Node> in later 2.x releases. Code that stores these
// handles names this type instead of either.
#include <utility>

#include <torch/csrc/autograd/variable.h>

namespace fsdp::autograd {

using GradAccumulatorHandle =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace fsdp::autograd
