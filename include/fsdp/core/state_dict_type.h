#pragma once
/// The state dict type a model is set to (see state_dict.h): kept on the model
/// itself (FullyShardedBase), selected by StateDictTypeGuard.

#include <torch/arg.h>

namespace fsdp {

enum class StateDictType {
  kFull,
  kLocal,
  kSharded,
  // The earlier spellings, kept deprecated (CHANGELOG.md, "Renamed").
  FULL [[deprecated("use kFull")]] = kFull,
  LOCAL [[deprecated("use kLocal")]] = kLocal,
  SHARDED [[deprecated("use kSharded")]] = kSharded,
};

struct FullStateDictConfig {
  /// Copy each gathered value to the CPU, unit by unit, so that a CUDA model's device holds
  /// one unit's full values at a time (a CPU model's values are copied either way).
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// Only rank 0 keeps the values; other ranks return an empty dict.
  TORCH_ARG(bool, rank0_only) = false;
};

namespace core::detail {
/// What StateDictTypeGuard selects; kFull with the default config when no guard is open.
struct StateDictSelection {
  StateDictType type = StateDictType::kFull;
  FullStateDictConfig config;
};
}  // namespace core::detail

}  // namespace fsdp
