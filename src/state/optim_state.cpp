#include "optim_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "memory/param_state_key.h"
#include "fsdp/optim/cpu_adam.h"

namespace fsdp::state {

namespace {
using memory::param_state_key;

template <typename S>
ParamOptimState adam_like(const S& s) {
  ParamOptimState out;
  out.step = s.step();
  if (s.exp_avg().defined()) out.tensors["exp_avg"] = s.exp_avg();
  if (s.exp_avg_sq().defined()) out.tensors["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out.tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
  return out;
}

template <typename S>
std::unique_ptr<S> make_adam_like(ParamOptimState& s) {
  auto st = std::make_unique<S>();
  st->step(s.step);
  if (s.tensors.count("exp_avg")) st->exp_avg(s.tensors["exp_avg"]);
  if (s.tensors.count("exp_avg_sq")) st->exp_avg_sq(s.tensors["exp_avg_sq"]);
  if (s.tensors.count("max_exp_avg_sq")) st->max_exp_avg_sq(s.tensors["max_exp_avg_sq"]);
  return st;
}
}  // namespace

std::string optimizer_kind(const torch::optim::Optimizer& opt) {
  if (dynamic_cast<const fsdp::optim::CPUAdam*>(&opt)) return "cpu_adam";
  if (dynamic_cast<const torch::optim::AdamW*>(&opt)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&opt)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&opt)) return "sgd";
  TORCH_CHECK(false, "fsdp checkpoint: optimizer type ", typeid(opt).name(),
              " is not supported; supported: torch::optim::Adam, AdamW, SGD and fsdp::optim::CPUAdam");
}

std::string optimizer_family(const std::string& kind) {
  return kind == "sgd" ? "sgd" : "adam";
}

std::optional<ParamOptimState> get_param_state(const torch::optim::Optimizer& opt, const at::Tensor& param) {
  const auto* base = memory::param_state(opt, param);
  if (!base) return std::nullopt;
  if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(base)) return adam_like(*s);
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(base)) return adam_like(*s);
  if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(base)) {
    ParamOptimState out;
    if (s->momentum_buffer().defined()) out.tensors["momentum_buffer"] = s->momentum_buffer();
    return out;
  }
  TORCH_CHECK(false, "fsdp checkpoint: unsupported optimizer state type ", typeid(*base).name());
}

void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, ParamOptimState s) {
  const std::string kind = optimizer_kind(opt);
  std::unique_ptr<torch::optim::OptimizerParamState> st;
  if (kind == "adamw") st = make_adam_like<torch::optim::AdamWParamState>(s);
  else if (kind == "adam" || kind == "cpu_adam") st = make_adam_like<torch::optim::AdamParamState>(s);
  else {
    auto sgd = std::make_unique<torch::optim::SGDParamState>();
    if (s.tensors.count("momentum_buffer")) sgd->momentum_buffer(s.tensors["momentum_buffer"]);
    st = std::move(sgd);
  }
  opt.state()[param_state_key(param)] = std::move(st);
}

void erase_param_state(torch::optim::Optimizer& opt, const at::Tensor& param) {
  opt.state().erase(param_state_key(param));
}

}  // namespace fsdp::state
