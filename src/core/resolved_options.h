#pragma once
// Options checked against the process group and resolved into the values the
// runtime uses, in one place (resolve_options), before the first collective: a
// rank with a bad option fails alone and at once instead of leaving its peers
// waiting in a collective. Below the wrapper only these values exist: nothing
// there sees the raw Options, reads the environment, or re-checks a value.

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

#include "fsdp/comm/process_group.h"
#include "fsdp/core/options.h"

namespace fsdp::core::detail {

/// The 1/world gradient average, split into a division before the reduction
/// and one after it (Options::gradient_predivide_factor); pre * post == world.
struct GradientDivision {
  double pre = 1;
  double post = 1;
};

struct ResolvedOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  /// Ranks that shard the parameters: shard_group_size under HYBRID_SHARD (0
  /// resolved to ranks per machine), the world size otherwise.
  int shard_group_size = 1;
  bool reshard_after_forward = false;
  GradientDivision divide;
  int64_t bucket_cap_bytes = 0;  // 0: every unit reduced alone
  /// Options::trace_dir, else the environment variable FSDP_TRACE, else "" (off).
  std::string trace_dir;
  /// Options::reduce_group, checked to span the shard group; undefined: the runtime
  /// makes one over the shard group's ranks.
  comm::ProcessGroup reduce_group;
  bool limit_all_gathers = true;
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  /// The policy as given; each unit's effective dtypes come from unit_precision.
  MixedPrecision mixed_precision;
  /// Options::keep_freed_host_memory, unless the environment tunes malloc itself.
  bool keep_freed_host_memory = true;
  /// Options::optimizer_in_backward ([Note: optimizer in backward]).
  bool optimizer_in_backward = false;
  /// Options::zero_copy_gather ([Note: zero-copy gathers] in flat_param.h).
  bool zero_copy_gather = false;
  /// Options::cpu_offload ([Note: offload] in flat_param.h).
  bool cpu_offload = false;
  /// Options::gpu_margin_mem_ratio ([Note: auto placement] in src/engine/placement.h).
  double gpu_margin_mem_ratio = 0;
  /// Where the model's parameters are, checked by model_device ([Note: device
  /// placement]); set by the wrapper, not by resolve_options.
  c10::Device device = c10::kCPU;
};

/// Checks every option that can be checked without collectives and resolves the
/// defaults. Throws c10::Error naming the option, the rank and the fix.
ResolvedOptions resolve_options(const Options& options, const comm::ProcessGroup& pg);

/// PyTorch's default split of the average over `world` ranks.
GradientDivision gradient_division(double predivide_factor, int world);

}  // namespace fsdp::core::detail
