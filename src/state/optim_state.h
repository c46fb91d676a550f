#pragma once
// Per-parameter optimizer state as named tensors, for the optimizers the
// checkpoint layer knows (torch::optim::Adam, AdamW, SGD; fsdp::optim::CPUAdam).
// libtorch keys state by the parameter's TensorImpl address
// (src/memory/param_state_key.h); the state layer reaches optimizer state only
// through these functions.

#include <map>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

namespace fsdp::state {

/// "adam", "adamw", "cpu_adam", "sgd"; throws naming the type otherwise.
std::string optimizer_kind(const torch::optim::Optimizer& opt);
/// Adam, AdamW and CPUAdam share one state layout.
std::string optimizer_family(const std::string& kind);

struct ParamOptimState {
  int64_t step = 0;                          // Adam family; 0 for SGD
  std::map<std::string, at::Tensor> tensors; // shaped like the parameter's data
};

/// The state of `param`, if the optimizer has any.
std::optional<ParamOptimState> get_param_state(const torch::optim::Optimizer& opt, const at::Tensor& param);
/// Replaces the state of `param` (keyed by its TensorImpl).
void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, ParamOptimState s);
/// Drops the state of `param`, if any (the optimizer starts it afresh).
void erase_param_state(torch::optim::Optimizer& opt, const at::Tensor& param);

}  // namespace fsdp::state
