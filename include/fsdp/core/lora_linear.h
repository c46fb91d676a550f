#pragma once
/// A Linear with a low-rank adapter (LoRA): y = x W^T + b + s (x A^T) B^T, W and b frozen,
/// A (rank x in) and B (out x rank) trainable, s = alpha / rank. B starts at zero, so a
/// fresh adapter computes exactly the Linear it was made from.
///
///     torch::nn::Linear pretrained(1024, 1024);  // trained elsewhere
///     auto layer = fsdp::LoRALinear(fsdp::LoRALinearOptions(1024, 1024).rank(8).alpha(16));
///     layer->load_linear(pretrained);             // W and b from it, frozen
///     torch::Tensor w = layer->merged_weight();   // W + s B A: the Linear to export
///
/// Inside FullyShardedDataParallel the frozen W and b of a unit cost no gradient, optimizer
/// or reduction bytes ([Note: frozen companions] in src/core/runtime.h): only A and B are
/// reduced and stepped. Parameter names: weight, bias (as a Linear's; none without bias),
/// lora_A, lora_B.

#include <cstdint>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace fsdp {

struct LoRALinearOptions {
  LoRALinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// The adapter's rank r (A is r x in, B is out x r).
  TORCH_ARG(int64_t, rank) = 8;
  /// The adapter's scale is alpha / rank.
  TORCH_ARG(double, alpha) = 16;
  TORCH_ARG(bool, bias) = true;
};

class LoRALinearImpl : public torch::nn::Cloneable<LoRALinearImpl> {
 public:
  explicit LoRALinearImpl(const LoRALinearOptions& options);
  /// W and b as a Linear initializes them (frozen), A as Kaiming-uniform, B zero.
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  /// Copies a Linear's weight and bias (same shapes) into W and b.
  void load_linear(const torch::nn::Linear& linear);
  /// W + s B A, detached: the weight of the equivalent Linear.
  torch::Tensor merged_weight() const;
  double scale() const { return options.alpha() / double(options.rank()); }

  LoRALinearOptions options;
  torch::Tensor weight, bias, lora_A, lora_B;
};
TORCH_MODULE(LoRALinear);

}  // namespace fsdp
