#pragma once
/// User-facing policies of FullyShardedDataParallel: sharding strategy, wrap
/// policy and the typed options (libtorch TORCH_ARG style: chained setters).

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>

#include "fsdp/comm/process_group.h"
#include "fsdp/precision/mixed_precision.h"

namespace fsdp {

/// How parameters, gradients and optimizer state are split across the group.
/// to_string() and parse_sharding_strategy() keep PyTorch's words ("FULL_SHARD", "full_shard").
enum class ShardingStrategy {
  kFullShard,    ///< ZeRO-3: parameters, gradients and optimizer state sharded
  kShardGradOp,  ///< ZeRO-2: parameters stay unsharded between forward and backward
  kNoShard,      ///< DDP: everything replicated, gradients all-reduced
  /// kFullShard inside groups of `shard_group_size` consecutive ranks, replicated
  /// across groups: gradients are reduce-scattered in the shard group, then the
  /// reduced shard is all-reduced over the ranks holding the same shard index.
  kHybridShard,
  // The earlier spellings, kept deprecated (CHANGELOG.md, "Renamed").
  FULL_SHARD [[deprecated("use kFullShard")]] = kFullShard,
  SHARD_GRAD_OP [[deprecated("use kShardGradOp")]] = kShardGradOp,
  NO_SHARD [[deprecated("use kNoShard")]] = kNoShard,
  HYBRID_SHARD [[deprecated("use kHybridShard")]] = kHybridShard,
};
const char* to_string(ShardingStrategy s);
/// "full_shard" | "shard_grad_op" | "no_shard" | "hybrid_shard" (case-insensitive);
/// throws otherwise.
ShardingStrategy parse_sharding_strategy(const std::string& name);

/// Decides which wrap candidates become units. Called bottom-up with the module
/// path (as in named_modules), the module, and the number of its parameters not
/// already owned by a unit below it. See [Note: wrap candidates] in wrappable.h.
using WrapPolicy =
    std::function<bool(const std::string& path, const torch::nn::Module& module, int64_t unwrapped_numel)>;

/// Options::param_init_fn: initialises one module's own parameters in place.
using ParamInitFn = std::function<void(torch::nn::Module& module)>;

/// Wraps a candidate once it holds at least `min_num_params` unwrapped parameters.
WrapPolicy size_based_policy(int64_t min_num_params);
/// Wraps every candidate.
WrapPolicy always_wrap_policy();
/// Wraps candidates whose path is in the list (manual wrapping): module paths as
/// named_modules() gives them ("blocks.3"), or patterns where `*` stands for the characters
/// of one component ("blocks.*", "h.*.mlp"). Wrapping fails, naming it, for a path that
/// matches no module, and for a module it matches that is no wrap candidate (with the
/// one-line change that makes it one: [Note: wrap candidates] in wrappable.h).
WrapPolicy path_policy(std::vector<std::string> paths);
/// Wraps candidates of the given module types (e.g. transformer blocks).
template <typename... ModuleImpls>
WrapPolicy module_type_policy() {
  return [](const std::string&, const torch::nn::Module& m, int64_t) {
    return ((dynamic_cast<const ModuleImpls*>(&m) != nullptr) || ...);
  };
}

/// When the unsharded parameters of the *next* unit are gathered in backward
/// (the order of gathers never changes, only their timing; see [Note: prefetch]
/// in runtime.h).
enum class BackwardPrefetch {
  kNone,          ///< gather a unit when its backward is reached
  kBackwardPre,   ///< issue the next unit's gather before this unit's gradients are computed
  kBackwardPost,  ///< issue it once this unit's gradients are computed
  // The earlier spellings, kept deprecated (CHANGELOG.md, "Renamed").
  NONE [[deprecated("use kNone")]] = kNone,
  BACKWARD_PRE [[deprecated("use kBackwardPre")]] = kBackwardPre,
  BACKWARD_POST [[deprecated("use kBackwardPost")]] = kBackwardPost,
};
const char* to_string(BackwardPrefetch p);

struct Options {
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  /// Empty: the whole model is one unit (the root).
  TORCH_ARG(WrapPolicy, auto_wrap_policy) = nullptr;
  /// Free unsharded parameters after forward. Default per strategy: true for
  /// FULL_SHARD, false otherwise. The unit that finished the previous
  /// iteration's forward last stays gathered: backward starts with it, so
  /// freeing it would only add a gather of the same bytes.
  TORCH_ARG(std::optional<bool>, reshard_after_forward) = std::nullopt;
  /// Gradients are divided by this before the reduction and by world/factor after.
  /// Must lie in [1, world size]. Default (0): torch.distributed.fsdp's choice, the
  /// first power of two f (from 1, doubling) with world % f != 0 or world / f <= f
  /// (2 ranks: 2, 3: 2, 4: 2, 8: 4, 16: 4).
  TORCH_ARG(double, gradient_predivide_factor) = 0;
  /// Modules (and their subtrees) whose parameters FSDP leaves alone: replicated,
  /// never synchronised, counted once by clip_grad_norm_.
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, ignored_modules) = {};
  /// Broadcast rank 0's parameters and buffers before sharding (inside a
  /// ShardedInitContext: each unit's parameters when it is sharded, so this too
  /// stays within one unit of extra memory).
  TORCH_ARG(bool, sync_module_states) = false;
  /// Initialises parameters just before they are sharded: called once for every
  /// module that registers parameters (like Module::apply, but module by module
  /// as each unit is sharded), with that module's full parameters, under
  /// NoGradGuard and before sync_module_states. Inside a ShardedInitContext this is
  /// the way to initialise units (their parameters are placeholders afterwards);
  /// there it runs when the unit's Wrappable is constructed, in construction
  /// order, and FullyShardedDataParallel runs it for the remaining modules. Values
  /// equal eager construction when the function draws no random numbers, or when
  /// every module is in a unit sharded at construction (same order).
  TORCH_ARG(ParamInitFn, param_init_fn) = nullptr;
  /// Group for gradient reduction; default: a dedicated group over the same ranks.
  TORCH_ARG(comm::ProcessGroup, reduce_group) = {};
  /// Reduced-precision compute and communication; see mixed_precision.h.
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  /// HYBRID_SHARD only: ranks per shard group (consecutive ranks). 0: ranks per
  /// machine (pg.local_world_size()). Must divide the world size.
  TORCH_ARG(int, shard_group_size) = 0;
  /// Backward prefetch of the next unit's parameters (FULL_SHARD/HYBRID_SHARD).
  /// Default BACKWARD_PRE, as in PyTorch: the next unit's gather overlaps this
  /// unit's gradient computation.
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  /// Gather the next unit during the current unit's forward, in the forward
  /// order recorded in the previous iteration.
  TORCH_ARG(bool, forward_prefetch) = false;
  /// At most one prefetched gather in flight besides the one being used, so
  /// prefetch holds at most two units' unsharded parameters at a time.
  TORCH_ARG(bool, limit_all_gathers) = true;
  /// Directory for a Chrome trace (one JSON file per rank, trace_rank<r>.json,
  /// written by FullyShardedBase::flush_trace and at destruction). Empty: the
  /// environment variable FSDP_TRACE, if set when the model is wrapped (read
  /// once, there); otherwise no trace.
  TORCH_ARG(std::string, trace_dir) = "";
  /// Keep freed tensor memory in the C library's heap for the next step
  /// (keep_freed_host_memory() in host_memory.h: process-wide glibc settings,
  /// skipped when the environment sets malloc tunables). false: leave malloc alone.
  TORCH_ARG(bool, keep_freed_host_memory) = true;
  /// Gradient reduction buckets, in MiB (FairScale's bucket_cap_mb; see [Note:
  /// reduce buckets] in src/core/grad_reducer.h). Consecutive units of the
  /// reduction order whose flat gradients together fit in the cap are reduced by
  /// one collective (one reduce-scatter, or one all-reduce under NO_SHARD) instead
  /// of one each; a unit whose flat gradient alone is >= the cap is reduced alone.
  /// Results are the same sums as without buckets (bit-identical for
  /// reduce-scatter; for all-reduce with more than 2 ranks Gloo's ring adds in an
  /// order that depends on the element's position, so equal to rounding).
  /// Values <= 0 disable bucketing.
  ///
  /// Default 0 (off): a bucket trades memory and overlap for fewer collectives.
  /// Its members' flat gradients stay alive until the bucket is issued, so the
  /// backward peak grows by up to the cap, and the first member's reduction waits
  /// for the last, so less of it overlaps backward. Units are sized by the wrap
  /// policy, which is the first knob (PyTorch FSDP has no buckets at all).
  /// Buckets are for models whose wrap policy leaves many tiny units (norms,
  /// biases, small heads), whose collectives each pay a fixed per-message cost;
  /// 1-4 MB then suffices. Measurements: docs/benchmarks.md, "Gradient buckets".
  TORCH_ARG(double, bucket_cap_mb) = 0;
  /// Step each unit's shard inside backward, the moment its reduction completes, with
  /// the optimizer given to FullyShardedBase::register_optimizer_in_backward (the user's
  /// own, e.g. torch::optim::AdamW or fsdp::optim::CPUAdam: its state and checkpoints
  /// are unchanged). Results are bitwise those of stepping after backward; gradients are
  /// freed unit by unit, so backward holds about one unit's reduced gradient instead of
  /// the whole model's. After such a backward no gradient is defined and the optimizer's
  /// own step() finds nothing to do. Refused while on: clip_grad_norm_, the loss
  /// scaler's inf check, LBFGS. Accumulation: only a backward outside no_sync() and
  /// no_step() steps. See [Note: optimizer in backward] in src/core/backward_optimizer.h.
  TORCH_ARG(bool, optimizer_in_backward) = false;
  /// On one host (shared memory between the shard group's ranks, the default there):
  /// each unit's shard lives in memory its peers map, and its gathered parameters map the
  /// peers' shards instead of copying them, so a gather moves only the few pages where
  /// two shards meet and waits for the peers. The gathered buffer costs no memory while
  /// the unit is gathered (it is mapped for good instead); values are bitwise those of
  /// copying gathers. Sharded strategies on the CPU, parameters gathered in their own
  /// dtype (no MixedPrecision::param_dtype), no cpu_offload; refused otherwise, and
  /// when the shard group does not share memory. See [Note: zero-copy gathers] in
  /// src/core/flat_param.h.
  TORCH_ARG(bool, zero_copy_gather) = false;
  /// CPU offload, named as PyTorch FSDP's argument (cpu_offload=CPUOffload(offload_params=True)),
  /// ColossalAI's and ZeroOptions::cpu_offload (FairScale: move_params_to_cpu +
  /// move_grads_to_cpu): each unit's shard (the full-precision
  /// master weights), its reduced gradient pieces and therefore the optimizer state
  /// live in host memory, pinned when the model is on a GPU. Only compute-dtype copies
  /// visit the model's device: a unit's shard is copied there for its all-gather, its
  /// gradients are reduced there, and the reduced shard is copied back to the host.
  /// Wrap the model on its device as usual, then build the optimizer over the wrapped
  /// parameters (host tensors): fsdp::optim::CPUAdam steps them at the host's memory
  /// bandwidth, and with optimizer_in_backward each unit steps as its gradient lands.
  /// Values equal those of the same training without offload when the optimizer is the
  /// same (on a CPU-only machine host and device are one memory: the copies and the
  /// accounting still run). See [Note: offload] in src/core/flat_param.h.
  TORCH_ARG(bool, cpu_offload) = false;

 public:
  /// The earlier name of cpu_offload, kept deprecated (CHANGELOG.md, "Renamed").
  [[deprecated("use cpu_offload")]] Options& offload_params(bool offload) { return cpu_offload(offload); }
  [[deprecated("use cpu_offload")]] bool offload_params() const { return cpu_offload(); }

  /// Placement "auto" (ColossalAI's gpu_margin_mem_ratio; ZeroOptions has the same): with
  /// cpu_offload and optimizer_in_backward, at the end of the first backward that steps,
  /// this fraction of the device memory that iteration left unused at its peak (the device's
  /// memory times the caching allocator's memory fraction, minus its peak allocated bytes)
  /// takes back units' shards and their optimizer state, in the order backward reduces the
  /// units, while they fit; those units are then stepped on the device (CPUAdam: with tensor
  /// ops there, its fused kernel on the host), the rest stay on the host. 0 (default): all
  /// stay on the host; 1: as many as fit. Decided once (units_placed_on_device() lists them).
  /// Needs optimizer_in_backward because the state moves with its shard, and FSDP knows the
  /// optimizer only when it steps it. See [Note: auto placement] in src/memory/placement.h.
  TORCH_ARG(double, gpu_margin_mem_ratio) = 0.0;
};

/// Options::bucket_cap_mb in bytes, 0 when bucketing is off (cap <= 0). Throws
/// c10::Error for a cap that is not a finite number of MiB or exceeds 2^40 MiB.
int64_t bucket_cap_bytes(const Options& options);

/// Bytes this rank holds, by category. "Unsharded" buffers are transient: gathered
/// parameters of units in flight, flat gradients being reduced, and gradients
/// accumulated under no_sync. "Cached" bytes are freed transient buffers FSDP
/// keeps for the next iteration (at most four blocks; on the CPU a fresh buffer
/// of this size is page-faulted in on every use); FullyShardedBase::empty_cache()
/// releases them.
struct MemoryStats {
  int64_t param_shard_bytes = 0;
  int64_t grad_shard_bytes = 0;
  int64_t unsharded_bytes = 0;
  int64_t unsharded_peak_bytes = 0;
  int64_t cached_bytes = 0;
  /// Of param_shard_bytes + grad_shard_bytes, the bytes in host memory because of
  /// Options::cpu_offload (0 without it).
  int64_t offloaded_bytes = 0;
};

}  // namespace fsdp
