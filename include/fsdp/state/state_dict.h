#pragma once
/// Model state dicts of a FullyShardedDataParallel (PyTorch's state_dict_type).
///
///     {
///       fsdp::StateDictTypeGuard guard(*model, fsdp::StateDictType::FULL,
///                                      fsdp::FullStateDictConfig().offload_to_cpu(true).rank0_only(true));
///       auto sd = fsdp::state_dict(*model);            // collective; empty on ranks != 0
///       if (rank == 0) fsdp::save_full_state_dict(sd, "model.pt");  // torch.load-able in Python
///     }
///
/// Keys are the parameter and buffer names of the unwrapped model, which are
/// also those of the equivalent torch.nn model in Python.
///
/// FULL: gathered unit by unit. Beyond its own shards and the dict it returns, a
/// rank holds at most one gathered unit at a time; with rank0_only the other
/// ranks return an empty dict and hold nothing beyond one unit.
/// SHARDED (not yet implemented) and LOCAL (not yet implemented) fail with a
/// message pointing at save_checkpoint, which stores the same per-piece data.

#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

#include "fsdp/fsdp/fully_sharded.h"

namespace fsdp {

enum class StateDictType { FULL, LOCAL, SHARDED };

struct FullStateDictConfig {
  /// Copy each gathered value to CPU (a no-op on this CPU-only build, kept for API parity).
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// Only rank 0 keeps the values; other ranks return an empty dict.
  TORCH_ARG(bool, rank0_only) = false;
};

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
  bool had_previous_;
  StateDictType previous_type_;
  FullStateDictConfig previous_config_;
};

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

/// The model's state dict of the type selected by the innermost guard (FULL,
/// default config, without one). Collective for FULL: every rank calls it.
StateDict state_dict(FullyShardedBase& model);

/// Loads a FULL state dict (every parameter and buffer, full shapes) on every
/// rank: each rank copies its own pieces out of it. Missing or mis-shaped
/// entries are errors naming the key. Not collective.
void load_state_dict(FullyShardedBase& model, const StateDict& dict);

/// Writes a full state dict as a plain dict of tensors that Python's torch.load
/// reads (torch::pickle_save format) / reads one written in Python by
/// torch.save(dict(model.state_dict()), path) (a plain dict: the OrderedDict that
/// state_dict() returns carries _metadata, which libtorch's unpickler rejects).
void save_full_state_dict(const StateDict& dict, const std::string& path);
StateDict load_full_state_dict(const std::string& path);

}  // namespace fsdp
