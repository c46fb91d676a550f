#pragma once
// The key under which libtorch optimizers (torch::optim::Adam, AdamW, SGD) and
// fsdp::optim::CPUAdam keep a parameter's state in Optimizer::state(): the
// address of the parameter's TensorImpl, as a string. CPUAdam and the state
// layer (src/state/optim_state.h) build it only here.

#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/string_utils.h>

namespace fsdp::optim::detail {

inline std::string param_state_key(const at::Tensor& param) {
  return c10::guts::to_string(param.unsafeGetTensorImpl());
}

}  // namespace fsdp::optim::detail
