#pragma once
// [Note: checkpoint subjects]
// A checkpoint directory describes every original parameter by name and the element
// ranges of its flattened value the records hold ([Note: checkpoint records]), never
// by who held them. So save and load need only, from whatever owns the parameters:
//  * the process group (every rank of it takes part);
//  * one LocalPiece per original parameter, on every rank, listing the same names in
//    the same order (rank 0's list becomes the metadata's items): `param` is the tensor
//    holding elements [begin, end) (a rank that holds none lists an empty range), the
//    tensor the optimizer steps and keys its state by; `writer` says whether this rank
//    saves it (each element saved once);
//  * the module whose buffers are saved (rank 0) and loaded (every rank).
// A FullyShardedDataParallel gives them through StateView (checkpoint.cpp); a
// ZeroRedundancyOptimizer through its pieces (zero_checkpoint.cpp). Hence a checkpoint
// saved by either loads into the other, at any world size.

#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "core/state_view.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/state/checkpoint.h"

namespace fsdp::state {

struct CheckpointSubject {
  comm::ProcessGroup group;
  std::string strategy;  // recorded in the metadata ("FULL_SHARD", "zero2", ...)
  std::vector<core::detail::LocalPiece> pieces;
  torch::nn::Module* module = nullptr;
  std::shared_ptr<Tracer> tracer;  // the model's schedule trace, if on (its checkpoint track)
};

/// save_checkpoint / load_checkpoint (fsdp/state/checkpoint.h) of any subject. The
/// optimizer's parameters must be the pieces' `param` tensors.
void save_checkpoint_of(const std::string& dir, const CheckpointSubject& subject,
                        const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra);
CheckpointExtra load_checkpoint_of(const std::string& dir, const CheckpointSubject& subject,
                                   torch::optim::Optimizer* optimizer);

}  // namespace fsdp::state
