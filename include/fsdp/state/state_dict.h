#pragma once
/// Model state dicts of a FullyShardedDataParallel (PyTorch's state_dict_type).
///
///     {
///       fsdp::StateDictTypeGuard guard(*model, fsdp::StateDictType::kFull,
///                                      fsdp::FullStateDictConfig().offload_to_cpu(true).rank0_only(true));
///       auto sd = fsdp::state_dict(*model);            // collective; empty on ranks != 0
///       if (rank == 0) fsdp::save_full_state_dict(sd, "model.pt");  // torch.load-able in Python
///     }
///
/// Keys are the parameter and buffer names of the unwrapped model, which are
/// also those of the equivalent torch.nn model in Python. A tied parameter (one
/// tensor registered under several names, e.g. an embedding and an output head)
/// appears under every name with the same values, as in Python's state_dict.
///
/// FULL: gathered unit by unit. Beyond its own shards and the dict it returns, a
/// rank holds at most one gathered unit at a time; with rank0_only the other
/// ranks return an empty dict and hold nothing beyond one unit.
/// LOCAL: this rank's flat shard of each unit ("<unit path>.flat_param", root:
/// "flat_param"; padded, as in [Note: padded flat buffer]) plus the buffers;
/// loads only into the same world size, strategy and wrap policy.
/// SHARDED: per original parameter, this rank's piece (1-D; full shape under
/// NO_SHARD) plus the buffers; sharded_state_dict() adds each piece's element
/// range [begin, end) of the flattened parameter. Loads where the pieces cover
/// the receiving rank's own (same layout); resharding is save_checkpoint's job.

#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/state_dict_type.h"

namespace fsdp {

/// Selects the state dict type of `model` for its scope, then restores the
/// previous one (the C++ form of FSDP.state_dict_type). Not thread-safe.
class StateDictTypeGuard {
 public:
  StateDictTypeGuard(FullyShardedBase& model, StateDictType type, FullStateDictConfig config = {});
  ~StateDictTypeGuard();
  StateDictTypeGuard(const StateDictTypeGuard&) = delete;
  StateDictTypeGuard& operator=(const StateDictTypeGuard&) = delete;

 private:
  FullyShardedBase* model_;
  core::detail::StateDictSelection previous_;
};

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

/// The model's state dict of the type selected by the innermost guard (FULL,
/// default config, without one). Collective for FULL: every rank calls it.
StateDict state_dict(FullyShardedBase& model);

/// One parameter's piece with its place in the full parameter.
struct ShardedEntry {
  at::Tensor local;            ///< this rank's elements [begin, end) of the flattened parameter
  std::vector<int64_t> shape;  ///< full shape
  int64_t begin = 0, end = 0;
};
using ShardedStateDict = torch::OrderedDict<std::string, ShardedEntry>;
/// SHARDED state dict with offsets (parameters only). Not collective.
ShardedStateDict sharded_state_dict(FullyShardedBase& model);
/// Loads pieces whose ranges cover this rank's own. Not collective.
void load_sharded_state_dict(FullyShardedBase& model, const ShardedStateDict& dict);

/// Loads a state dict of the type selected by the innermost guard (FULL by
/// default). FULL: every parameter and buffer, full shapes, on every rank; each
/// rank copies its own pieces out of it; a tied parameter needs any one of its
/// names, and names present together must hold equal values. LOCAL / SHARDED: what state_dict()
/// returned on this rank under that type (same world size and layout). Missing
/// or mis-shaped entries are errors naming the key. Not collective.
void load_state_dict(FullyShardedBase& model, const StateDict& dict);

/// Writes a full state dict as a plain dict of tensors that Python's torch.load
/// reads (torch::pickle_save format) / reads one written in Python by
/// torch.save(dict(model.state_dict()), path) (a plain dict: the OrderedDict that
/// state_dict() returns carries _metadata, which libtorch's unpickler rejects).
void save_full_state_dict(const StateDict& dict, const std::string& path);
StateDict load_full_state_dict(const std::string& path);

}  // namespace fsdp
