#pragma once
// The key under which libtorch optimizers (torch::optim::Adam, AdamW, SGD) and
// fsdp::optim::CPUAdam keep a parameter's state in Optimizer::state(): the
// address of the parameter's TensorImpl (libtorch 2.x keys the map by `void*`).
// Everything that keys or looks up a parameter's state (CPUAdam, ZeRO, FSDP's
// placement, the state layer) does it through here.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

namespace fsdp::memory {

using ParamStateKey = void*;

inline ParamStateKey param_state_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }

/// `param`'s state in `opt`, or null where it has none (yet).
inline const torch::optim::OptimizerParamState* param_state(const torch::optim::Optimizer& opt,
                                                            const at::Tensor& param) {
  auto it = opt.state().find(param_state_key(param));
  return it == opt.state().end() ? nullptr : it->second.get();
}

}  // namespace fsdp::memory
