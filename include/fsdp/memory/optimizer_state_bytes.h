#pragma once
// Bytes of an optimizer's per-parameter state tensors (MemoryCategory::kOptimizerState), one
// definition for every report that shows them: the memory tracer, ZeroRedundancyOptimizer's
// get_memory_usage() and the Trainer's / fsdp-train's memory summary.
//
// Counted: Adam and AdamW moments (and max_exp_avg_sq under amsgrad; CPUAdam keeps
// AdamParamState too), SGD momentum buffers, RMSprop's square_avg / momentum_buffer / grad_avg,
// Adagrad's sum. Step counters are scalars and not counted. A state class not listed here
// counts 0: add it here rather than in a caller.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::optim {
class Optimizer;
struct OptimizerParamState;
}  // namespace torch::optim

namespace fsdp::memory {

int64_t optimizer_state_bytes(const torch::optim::OptimizerParamState& state);
/// The state's tensors (handles sharing the state's TensorImpls; undefined ones left out), for
/// those classes; none for others.
std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::OptimizerParamState& state);
/// Sum over `opt.state()` (the parameters this optimizer has stepped so far).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt);
/// Moves the state's tensors to `device` in place (their TensorImpls, which the state
/// holds, stay; values copied): placement moving a parameter moves its state with it.
void move_optimizer_state(const torch::optim::OptimizerParamState& state, const c10::Device& device);

}  // namespace fsdp::memory
