#include "fsdp/core/lora_linear.h"

#include <cmath>

#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>
#include <torch/torch.h>

namespace fsdp {

LoRALinearImpl::LoRALinearImpl(const LoRALinearOptions& options_) : options(options_) {
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0, "fsdp::LoRALinear: in_features (",
              options.in_features(), ") and out_features (", options.out_features(), ") must be positive");
  TORCH_CHECK(options.rank() > 0 && options.rank() <= std::min(options.in_features(), options.out_features()),
              "fsdp::LoRALinear: rank ", options.rank(), " must be in [1, min(in_features, out_features)] = [1, ",
              std::min(options.in_features(), options.out_features()), "]");
  reset();
}

void LoRALinearImpl::reset() {
  const int64_t in = options.in_features(), out = options.out_features(), r = options.rank();
  weight = register_parameter("weight", torch::empty({out, in}), /*requires_grad=*/false);
  if (options.bias()) bias = register_parameter("bias", torch::empty({out}), /*requires_grad=*/false);
  lora_A = register_parameter("lora_A", torch::empty({r, in}));
  lora_B = register_parameter("lora_B", torch::zeros({out, r}));
  torch::NoGradGuard no_grad;
  // As torch::nn::Linear initializes (Kaiming-uniform with a = sqrt(5), bias from the fan-in).
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  torch::nn::init::kaiming_uniform_(lora_A, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(double(in));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

torch::Tensor LoRALinearImpl::forward(const torch::Tensor& x) {
  namespace F = torch::nn::functional;
  return F::linear(x, weight, bias) + scale() * F::linear(F::linear(x, lora_A), lora_B);
}

void LoRALinearImpl::load_linear(const torch::nn::Linear& linear) {
  TORCH_CHECK(linear->weight.sizes() == weight.sizes(), "fsdp::LoRALinear::load_linear: the Linear's weight is ",
              linear->weight.sizes(), ", this layer's is ", weight.sizes());
  TORCH_CHECK(linear->bias.defined() == bias.defined(), "fsdp::LoRALinear::load_linear: the Linear ",
              linear->bias.defined() ? "has" : "has no", " bias, this layer ", bias.defined() ? "has" : "has none");
  torch::NoGradGuard no_grad;
  weight.copy_(linear->weight);
  if (bias.defined()) bias.copy_(linear->bias);
}

torch::Tensor LoRALinearImpl::merged_weight() const {
  torch::NoGradGuard no_grad;
  return weight + scale() * lora_B.mm(lora_A);
}

}  // namespace fsdp
