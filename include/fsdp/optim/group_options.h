// fsdp::optim::keep_group_options: a parameter group's own options, exactly as given.
#pragma once

#include <vector>

#include <torch/optim/optimizer.h>

namespace fsdp {
namespace optim {

/// Sets the options of `opt`'s first `given.size()` parameter groups to copies of the options
/// of `given` (a group without options keeps what the optimizer gave it: its defaults).
///
/// libtorch's Optimizer::add_param_group does not keep a group's options in every 2.x release:
/// newer ones replace the options of types they do not know (CPUAdamOptions, any custom
/// optimizer's) by the optimizer's defaults, and merge known types field by field with the
/// defaults, taking a value equal to the options type's own default (an explicit
/// `weight_decay(0)` on AdamOptions) as unset. Call this after constructing an optimizer from
/// groups to get what was asked for on every version; CPUAdam, ZeroRedundancyOptimizer and
/// `inner_optimizer` do.
///
///     torch::optim::AdamW opt(groups, torch::optim::AdamWOptions(1e-3));
///     fsdp::optim::keep_group_options(opt, groups);
void keep_group_options(torch::optim::Optimizer& opt,
                        const std::vector<torch::optim::OptimizerParamGroup>& given);

/// add_param_group, then the group's own options as given (see keep_group_options).
void add_param_group_keeping_options(torch::optim::Optimizer& opt,
                                     const torch::optim::OptimizerParamGroup& group);

}  // namespace optim
}  // namespace fsdp
