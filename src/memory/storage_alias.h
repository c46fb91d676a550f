#pragma once
// Internal to src: a gradient that shares another tensor's memory without a copy.
#include <ATen/ATen.h>

namespace fsdp::memory {

/// A tensor on the same memory as `view` that autograd does not know as a view:
/// optimizers call grad.detach_() in zero_grad, which views refuse. FSDP's gradient
/// pieces share the reduced shard's memory this way, and ZeRO-1's gradients the
/// all-reduced bucket's.
inline at::Tensor storage_alias(const at::Tensor& view) {
  at::NoGradGuard no_grad;
  return at::empty({0}, view.options()).set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
}

}  // namespace fsdp::memory
