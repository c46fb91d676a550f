#pragma once
/// summon_full_params as a scoped guard: within its scope the parameters of the
/// unwrapped model have their full shapes and values on every rank.
///
///     {
///       fsdp::SummonFullParams full(*model, fsdp::SummonFullParamsOptions().writeback(true));
///       model->module()->head->weight.mul_(0.5);   // written back into the shards at scope exit
///     }
///
/// Collective (every rank constructs it). Must be used between training steps;
/// forward/backward inside the scope are not supported. Under mixed precision
/// the parameters show their full-precision (shard dtype) values. Under NO_SHARD
/// the full parameters are the shard itself, so changes stick even without
/// writeback.

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "fsdp/core/fully_sharded.h"

namespace fsdp {

struct SummonFullParamsOptions {
  /// Every unit (true) or only the root unit's own parameters (false).
  TORCH_ARG(bool, recurse) = true;
  /// Copy changes made inside the scope back into this rank's shard at exit.
  TORCH_ARG(bool, writeback) = true;
  /// Only rank 0 sees full parameters; the others keep their pieces (they still
  /// take part in the gathers). Incompatible with writeback.
  TORCH_ARG(bool, rank0_only) = false;
  /// Accepted for API parity; parameters are on the CPU already in this build.
  TORCH_ARG(bool, offload_to_cpu) = false;
};

class SummonFullParams {
 public:
  SummonFullParams(FullyShardedBase& model, SummonFullParamsOptions options = {});
  ~SummonFullParams() noexcept(false);
  SummonFullParams(const SummonFullParams&) = delete;
  SummonFullParams& operator=(const SummonFullParams&) = delete;

 private:
  // apply_with_full_params is this guard around a call; `what` names the caller in errors.
  friend void apply_with_full_params(FullyShardedBase&, const std::function<void(torch::nn::Module&)>&);
  SummonFullParams(FullyShardedBase& model, SummonFullParamsOptions options, const char* what);

  FullyShardedBase* model_;
  SummonFullParamsOptions options_;
  std::vector<int> units_;  // indices of the units this guard unsharded
  std::vector<at::Tensor> buffers_;  // their full flat buffers (shard dtype)
};

/// Runs fn on the unwrapped model with full parameters, on every rank, then writes
/// parameter changes back into the shards: SummonFullParams with write-back around fn.
/// Collective; between training steps only.
void apply_with_full_params(FullyShardedBase& model, const std::function<void(torch::nn::Module&)>& fn);

}  // namespace fsdp
