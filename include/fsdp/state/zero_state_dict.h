#pragma once
/// Optimizer state dicts of a fsdp::optim::ZeroRedundancyOptimizer, in the layout of
/// [Note: OptimStateDict] (optim_state_dict.h): full-shape tensors keyed by the
/// parameter's name in the model. Such a dict does not depend on the world size or the
/// stage that made it, so it loads into a ZeroRedundancyOptimizer at any world size, and
/// it has the layout of FullyShardedDataParallel's full_optim_state_dict (which
/// scatter_full_optim_state_dict / shard_full_optim_state_dict take).
///
///     auto osd = fsdp::consolidate_state_dict(opt, /*to=*/0);   // collective; rank 0 holds it
///     if (pg.rank() == 0) fsdp::save_optim_state_dict(osd, "optim.pt");
///     ...
///     fsdp::load_consolidated_state_dict(opt2, fsdp::load_optim_state_dict_file("optim.pt"));
///
/// Inner optimizers: torch::optim::Adam, AdamW, SGD and fsdp::optim::CPUAdam. The
/// optimizer must have been built with ZeroOptions::module (the names). Hyperparameters
/// are not loaded (the receiving optimizer keeps its own).

#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/optim_state_dict.h"

namespace fsdp {

/// PyTorch's ZeroRedundancyOptimizer.consolidate_state_dict(to) followed by
/// state_dict(): every parameter's state, gathered onto rank `to` (the other ranks
/// return an empty dict). Collective over the optimizer's process group.
OptimStateDict consolidate_state_dict(optim::ZeroRedundancyOptimizer& opt, int to = 0);

/// Loads a full (name-keyed) dict: each rank keeps the slices of its pieces; parameters
/// the dict has no state for start afresh. Not collective; every rank needs the dict.
void load_consolidated_state_dict(optim::ZeroRedundancyOptimizer& opt, const OptimStateDict& full);

}  // namespace fsdp
