#pragma once
// The key under which libtorch optimizers (torch::optim::Adam, AdamW, SGD) and
// fsdp::optim::CPUAdam keep a parameter's state in Optimizer::state(): the
// address of the parameter's TensorImpl (libtorch 2.x keys the map by `void*`).
// Everything that looks a parameter's state up (CPUAdam, ZeRO, FSDP's placement,
// the state layer) builds it only here.

#include <ATen/core/Tensor.h>

namespace fsdp::memory {

using ParamStateKey = void*;

inline ParamStateKey param_state_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }

}  // namespace fsdp::memory
