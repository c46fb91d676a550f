#pragma once
// The key under which libtorch optimizers (torch::optim::Adam, AdamW, SGD) and
// fsdp::optim::CPUAdam keep a parameter's state in Optimizer::state(): the
// address of the parameter's TensorImpl (libtorch 2.x keys the map by `void*`).
// CPUAdam and the state layer (src/state/optim_state.h) build it only here.

#include <ATen/core/Tensor.h>

namespace fsdp::optim::detail {

using ParamStateKey = void*;

inline ParamStateKey param_state_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }

}  // namespace fsdp::optim::detail
