#include "fsdp/memory/optimizer_state_bytes.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace fsdp::memory {

namespace {

std::vector<at::Tensor> defined(std::initializer_list<at::Tensor> ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts)
    if (t.defined()) out.push_back(t);
  return out;
}

}  // namespace

std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::OptimizerParamState& s) {
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(&s))
    return defined({a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()});
  if (auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(&s))
    return defined({a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()});
  if (auto* a = dynamic_cast<const torch::optim::SGDParamState*>(&s)) return defined({a->momentum_buffer()});
  if (auto* a = dynamic_cast<const torch::optim::AdagradParamState*>(&s)) return defined({a->sum()});
  if (auto* a = dynamic_cast<const torch::optim::RMSpropParamState*>(&s))
    return defined({a->square_avg(), a->momentum_buffer(), a->grad_avg()});
  return {};
}

int64_t optimizer_state_bytes(const torch::optim::OptimizerParamState& s) {
  int64_t total = 0;
  for (const auto& t : optimizer_state_tensors(s)) total += static_cast<int64_t>(t.nbytes());
  return total;
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  int64_t total = 0;
  for (const auto& kv : opt.state())
    if (kv.second) total += optimizer_state_bytes(*kv.second);
  return total;
}

void move_optimizer_state(const torch::optim::OptimizerParamState& state, const c10::Device& device) {
  for (at::Tensor t : optimizer_state_tensors(state)) {
    at::Tensor moved = at::empty_like(t, t.options().device(device).pinned_memory(false));
    moved.copy_(t);
    t.set_data(moved);
  }
}

}  // namespace fsdp::memory
