#pragma once
// Internal to src/optim: which parameters a ZeroRedundancyOptimizer trains, and in
// which order. The user's groups are checked (defined, leaf, dense, each parameter in
// one group); parameters that do not require a gradient are frozen (replicated, never
// stepped); the trainable ones are put in flat order, reverse registration order in
// the model when one is given ([Note: ZeRO partition layout] in zero_layout.h), and
// must share one dtype and device, since they will share one flat buffer.
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

namespace fsdp::optim::detail {

struct ZeroTrainable {
  at::Tensor param;
  std::string name;  ///< for messages: "'path' (param_groups[g][j])", or the group position
  std::string key;   ///< its path in the module ("" without a module)
  int group = 0;     ///< index into the user's groups
};

struct ZeroParameters {
  std::vector<ZeroTrainable> trainable;  ///< in flat order
  std::vector<at::Tensor> frozen;
};

/// Sorts `groups`' parameters for a ZeroRedundancyOptimizer of rank `rank` over
/// `module` (may be null). Fails naming the parameter and the fix.
ZeroParameters collect_parameters(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                  const torch::nn::Module* module, bool mixed_precision, int rank);

}  // namespace fsdp::optim::detail
