#pragma once
/// PyTorch Distributed Checkpoint (DCP) directories, both ways: continue in C++ a run that
/// Python's FSDP2 saved, and hand a C++ run back to Python, at any world size on either side.
///
///     // Python: dcp.save({"model": msd, "optim": osd}, checkpoint_id="ckpt")
///     //         where msd, osd = get_state_dict(model, optimizer)
///     fsdp::load_dcp(*model, &optimizer, "ckpt");   // collective; any world size
///     // ... train ...
///     fsdp::save_dcp(*model, &optimizer, "ckpt2");  // Python: dcp.load({"model": ..., "optim": ...}, ...)
///
/// [Note: loading DCP]
/// A DCP directory is a `.metadata` file (a pickle of torch.distributed.checkpoint's
/// Metadata: every flattened key, e.g. "model.0.weight" or "optim.state.0.weight.exp_avg",
/// with its global shape, dtype and the boxes, offsets and sizes per dimension, that were
/// saved of it) and `.distcp` files holding each box as a torch.save archive at an offset.
/// Each rank reads the boxes that overlap its shard of each parameter and copies the
/// overlapping elements; a box is read once and whole, so a rank holds at most one box
/// beyond its shards. Parameters and buffers come from "<model_key>.<name>" (a tied
/// parameter under any of its names); with an optimizer, each parameter's state from
/// "<optim_key>.state.<name>.<state>" (Adam's exp_avg, exp_avg_sq and step, SGD's
/// momentum_buffer: as get_state_dict in Python names them) and each group's learning rate
/// from "<optim_key>.param_groups.<g>.lr"; the other hyperparameters are the optimizer's own.
/// The load is collective: the ranks agree after matching names (a missing or mis-shaped
/// key fails every rank before any value changed) and after reading.
///
/// [Note: saving DCP]
/// Each rank writes its own file `__<rank>_0.distcp` with its pieces: a piece that starts
/// or ends inside a row is saved as the boxes it is made of ([Note: boxes of a flat range]
/// in src/state/dcp_boxes.h), as many as three for a matrix, each a torch.save archive.
/// Rank 0 writes the `.metadata` Python's reader expects, the optimizer's param_groups as
/// Python's Adam, AdamW or SGD holds them, and renames the finished `<dir>.tmp` into place.

#include <cstdint>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "fsdp/core/fully_sharded.h"

namespace fsdp {

struct DcpOptions {
  /// The top-level keys of the saved dict: {"model": ..., "optim": ...} in Python.
  TORCH_ARG(std::string, model_key) = "model";
  TORCH_ARG(std::string, optim_key) = "optim";
  /// Load: keys of the model that the checkpoint lacks and model keys of the checkpoint
  /// the model lacks are an error listing them (true), or returned (false).
  TORCH_ARG(bool, strict) = true;
};

struct DcpLoadResult {
  std::vector<std::string> missing_keys;     ///< model names the checkpoint did not fill
  std::vector<std::string> unexpected_keys;  ///< checkpoint keys under model_key that filled nothing
  int64_t bytes_read = 0;                    ///< this rank's bytes read from the .distcp files
};

/// Loads the DCP directory `dir` into `model` and, when `optimizer` is not null, its state
/// ([Note: loading DCP]). Collective; the model must be between training steps.
DcpLoadResult load_dcp(FullyShardedBase& model, torch::optim::Optimizer* optimizer, const std::string& dir,
                       const DcpOptions& options = {});
/// The same into an unsharded module (and a torch optimizer over its parameters). Not
/// collective.
DcpLoadResult load_dcp(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& dir,
                       const DcpOptions& options = {});

/// Saves `model` and, when not null, `optimizer` (Adam, AdamW or SGD) as a DCP directory
/// that Python's dcp.load reads into FSDP2 (or any model) at any world size
/// ([Note: saving DCP]). Collective.
void save_dcp(FullyShardedBase& model, torch::optim::Optimizer* optimizer, const std::string& dir,
              const DcpOptions& options = {});

}  // namespace fsdp
