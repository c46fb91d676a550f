// The reentrant checkpoint ([Note: activation checkpoint] in
// include/fsdp/autograd/activation_checkpoint.h) as a libtorch custom Function.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "autograd/nesting.h"
#include "autograd/rng_fork.h"
#include "fsdp/autograd/activation_checkpoint.h"

namespace fsdp::autograd::detail {

namespace {

// What the backward needs besides the saved arguments.
struct Recompute : torch::CustomClassHolder {
  TensorFn fn;
  RngStates rng;
  size_t num_outputs = 0;
};

c10::intrusive_ptr<Recompute> recompute_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data.at("recompute").toCapsule());
}

// The arguments for the recompute: the saved ones, cut from the first forward's graph, and
// requiring grad where backward wants their gradient.
std::vector<at::Tensor> recompute_inputs(torch::autograd::AutogradContext* ctx) {
  std::vector<at::Tensor> inputs = ctx->get_saved_variables();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    inputs[i] = inputs[i].detach();
    if (ctx->needs_input_grad(i)) inputs[i].requires_grad_(true);
  }
  return inputs;
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `inputs`: the caller's tensors, then the dummy.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                c10::intrusive_ptr<Recompute> recompute) {
    std::vector<at::Tensor> args(inputs.begin(), inputs.end() - 1);
    recompute->rng = RngStates::capture(args);
    ctx->save_for_backward(args);
    ctx->saved_data["recompute"] = at::IValue::make_capsule(recompute);
    std::vector<at::Tensor> out;
    {
      CheckpointedForwardScope scope;
      out = recompute->fn(args);
    }
    recompute->num_outputs = out.size();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto recompute = recompute_of(ctx);
    std::vector<at::Tensor> inputs = recompute_inputs(ctx);
    std::vector<at::Tensor> outputs;
    {
      RngFork rng(recompute->rng);
      at::AutoGradMode grad(true);
      RecomputeScope scope;
      outputs = recompute->fn(inputs);
    }
    TORCH_CHECK(outputs.size() == recompute->num_outputs, "fsdp::checkpoint: the recompute in backward returned ",
                outputs.size(), " tensors where the first forward returned ", recompute->num_outputs,
                ". The checkpointed function must compute the same thing when called again with the same "
                "arguments; move state that changes between calls out of it");
    std::vector<at::Tensor> roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined() || !outputs[i].requires_grad() || !grad_outputs[i].defined()) continue;
      roots.push_back(outputs[i]);
      grads.push_back(grad_outputs[i]);
    }
    if (!roots.empty()) run_nested_backward([&] { torch::autograd::backward(roots, grads); });
    torch::autograd::variable_list result;
    for (const auto& in : inputs) result.push_back(in.defined() && in.requires_grad() ? in.grad() : at::Tensor());
    result.emplace_back();  // the dummy
    result.emplace_back();  // `recompute`, not a tensor
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint_tensors(TensorFn fn, const std::vector<at::Tensor>& inputs) {
  if (!at::GradMode::is_enabled()) return fn(inputs);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->fn = std::move(fn);
  // A dummy that requires grad: without it a call whose arguments all do without grad
  // would have no backward, and the parameters fn uses would get no gradients.
  std::vector<at::Tensor> with_dummy(inputs);
  with_dummy.push_back(at::empty({0}).requires_grad_(true));
  return CheckpointFunction::apply(at::TensorList(with_dummy), recompute);
}

}  // namespace fsdp::autograd::detail
