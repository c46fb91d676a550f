#pragma once
// The adapter FSDP puts in place of a torch::nn::Sequential entry that became a
// unit (see [Note: wrap candidates]). Only the Sequential's AnyModule slot is
// swapped; the registered child stays the user's module, so parameter names and
// named_modules() do not change. The slot is restored when FSDP is destroyed.
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include "fsdp/core/wrappable.h"

namespace fsdp::core::detail {

class SequentialEntryImpl : public torch::nn::Module {
 public:
  SequentialEntryImpl(torch::nn::AnyModule inner, UnitHooks* hooks)
      : inner_(std::move(inner)), hooks_(hooks) {}
  torch::Tensor forward(torch::Tensor x) {
    hooks_->pre_forward();
    torch::Tensor out = inner_.forward(core::detail::cast_forward_input(std::move(x), hooks_->forward_input_dtype()));
    hooks_->post_forward({out});
    return out;
  }
  const torch::nn::AnyModule& inner() const { return inner_; }

 private:
  torch::nn::AnyModule inner_;
  UnitHooks* hooks_;
};

struct SequentialSlot {
  std::shared_ptr<torch::nn::SequentialImpl> sequential;
  size_t index;
  torch::nn::AnyModule original;
};

}  // namespace fsdp::core::detail
