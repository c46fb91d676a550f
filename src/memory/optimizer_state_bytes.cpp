#include "fsdp/memory/optimizer_state_bytes.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace fsdp::memory {

namespace {

int64_t n(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : int64_t{0}; }

}  // namespace

int64_t optimizer_state_bytes(const torch::optim::OptimizerParamState& s) {
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(&s))
    return n(a->exp_avg()) + n(a->exp_avg_sq()) + n(a->max_exp_avg_sq());
  if (auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(&s))
    return n(a->exp_avg()) + n(a->exp_avg_sq()) + n(a->max_exp_avg_sq());
  if (auto* a = dynamic_cast<const torch::optim::SGDParamState*>(&s)) return n(a->momentum_buffer());
  if (auto* a = dynamic_cast<const torch::optim::AdagradParamState*>(&s)) return n(a->sum());
  if (auto* a = dynamic_cast<const torch::optim::RMSpropParamState*>(&s))
    return n(a->square_avg()) + n(a->momentum_buffer()) + n(a->grad_avg());
  return 0;
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  int64_t total = 0;
  for (const auto& kv : opt.state())
    if (kv.second) total += optimizer_state_bytes(*kv.second);
  return total;
}

}  // namespace fsdp::memory
