#pragma once
/// Mixed-precision policy of FullyShardedDataParallel (PyTorch's
/// MixedPrecision; FairScale's mixed_precision / compute_dtype /
/// fp32_reduce_scatter). See [Note: mixed precision] in src/core/flat_param.h; each unit's dtypes are
/// src/precision/flat_precision.h.
///
///     auto options = fsdp::Options().mixed_precision(fsdp::MixedPrecision()
///         .param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat));
///
/// The parameters the optimizer sees stay in the model's dtype (fp32 master
/// pieces). Each rank casts its piece to param_dtype before the all-gather, so
/// forward and backward compute with param_dtype parameters and the gather moves
/// param_dtype bytes; gradients are reduce-scattered in reduce_dtype and handed
/// to the optimizer in the model's dtype. Bytes per rank with Adam, Ψ fp32
/// parameters, bf16 param_dtype, N ranks, outside forward/backward (shards +
/// gradient pieces + Adam's two moments): FULL_SHARD 16Ψ/N; SHARD_GRAD_OP
/// 2Ψ + 16Ψ/N while parameters stay gathered between forward and backward;
/// NO_SHARD 16Ψ plus the 2Ψ low-precision copy during forward/backward; plus
/// the low-precision units in flight (MemoryStats::unsharded_bytes).
///
/// On CPU with libtorch 1.13 fp16 matmul does not exist: param_dtype kHalf is
/// rejected at construction on CPU; fp16 works as reduce_dtype. Gloo has no
/// bf16: bf16 collectives move raw bytes and sum locally (collectives.cpp).

#include <optional>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

namespace fsdp {

struct MixedPrecision {
  /// Dtype of the gathered parameters forward and backward compute with.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  /// Dtype gradients are reduced in (default: param_dtype, as in PyTorch).
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  /// Buffers (other than those of full-precision BatchNorm layers) are
  /// converted to this dtype once, at wrapping.
  TORCH_ARG(std::optional<at::ScalarType>, buffer_dtype) = std::nullopt;
  /// Leave the gradient pieces in param_dtype instead of the model's dtype.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  /// Cast floating-point tensor arguments of the root's and every unit's
  /// forward to param_dtype.
  TORCH_ARG(bool, cast_forward_inputs) = true;
  /// Put each BatchNorm layer's parameters in a unit of their own that stays in
  /// the model's dtype (running statistics too), as PyTorch does; these units
  /// are replicated, not sharded, and their gradients all-reduced. false: BatchNorm
  /// computes in param_dtype like everything else.
  TORCH_ARG(bool, full_precision_batch_norm) = true;

 public:  // TORCH_ARG leaves the section private

  /// FairScale spelling: reduce in fp32 (true) or in param_dtype (false).
  MixedPrecision& fp32_reduce_scatter(bool v) {
    reduce_dtype_ = v ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
    return *this;
  }
  /// FairScale spelling of param_dtype.
  MixedPrecision& compute_dtype(at::ScalarType t) {
    param_dtype_ = t;
    return *this;
  }
  bool enabled() const { return param_dtype_ || reduce_dtype_ || buffer_dtype_; }
  /// Reduce dtype actually used for a parameter of dtype `model_dtype`.
  at::ScalarType effective_reduce_dtype(at::ScalarType model_dtype) const {
    return reduce_dtype_.value_or(param_dtype_.value_or(model_dtype));
  }
};

}  // namespace fsdp
