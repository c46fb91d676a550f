#include "fsdp/core/options.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "fsdp/core/host_memory.h"
#include "path_policy.h"
#include "resolved_options.h"

namespace fsdp {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "?";
}

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "full_shard") return ShardingStrategy::kFullShard;
  if (n == "shard_grad_op") return ShardingStrategy::kShardGradOp;
  if (n == "no_shard") return ShardingStrategy::kNoShard;
  if (n == "hybrid_shard") return ShardingStrategy::kHybridShard;
  TORCH_CHECK(false, "fsdp: unknown sharding strategy '", name,
              "'; expected one of full_shard, shard_grad_op, no_shard, hybrid_shard");
}

const char* to_string(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::kNone: return "NONE";
    case BackwardPrefetch::kBackwardPre: return "BACKWARD_PRE";
    case BackwardPrefetch::kBackwardPost: return "BACKWARD_POST";
  }
  return "?";
}

int64_t bucket_cap_bytes(const Options& options) {
  const double mb = options.bucket_cap_mb();
  constexpr double kMaxMb = 1099511627776.0;  // 2^40 MiB: 2^60 bytes still fit an int64_t
  TORCH_CHECK(std::isfinite(mb) && mb <= kMaxMb, "fsdp: Options::bucket_cap_mb must be a finite number of "
              "MiB no larger than 2^40 (values <= 0 disable gradient buckets), got ", mb);
  if (mb <= 0) return 0;
  return static_cast<int64_t>(mb * 1024 * 1024);
}

namespace core::detail {

GradientDivision gradient_division(double predivide_factor, int world) {
  double pre = predivide_factor;
  if (pre == 0) {
    // PyTorch's default: keeps low-precision sums in range.
    int factor = 1;
    while (world % factor == 0 && world / factor > factor) factor *= 2;
    pre = factor;
  }
  return GradientDivision{pre, world / pre};
}

namespace {

double checked_margin_ratio(const Options& o, int rank) {
  const double ratio = o.gpu_margin_mem_ratio();
  TORCH_CHECK(std::isfinite(ratio) && ratio >= 0 && ratio <= 1, "fsdp (rank ", rank,
              "): gpu_margin_mem_ratio must be in [0, 1], got ", ratio);
  TORCH_CHECK(ratio == 0 || o.cpu_offload(), "fsdp (rank ", rank, "): gpu_margin_mem_ratio places offloaded "
              "shards back on the device, but cpu_offload is off; add cpu_offload(true) or drop "
              "gpu_margin_mem_ratio");
  TORCH_CHECK(ratio == 0 || o.optimizer_in_backward(), "fsdp (rank ", rank, "): gpu_margin_mem_ratio moves each "
              "placed unit's optimizer state with its shard, and FSDP knows the optimizer only when it steps it in "
              "backward; add optimizer_in_backward(true) (and register_optimizer_in_backward) or drop "
              "gpu_margin_mem_ratio");
  return ratio;
}

}  // namespace

ResolvedOptions resolve_options(const Options& options, const comm::ProcessGroup& pg) {
  ResolvedOptions r;
  const int n = pg.size();
  const auto strategy = options.sharding_strategy();
  const bool hybrid = strategy == ShardingStrategy::kHybridShard;
  TORCH_CHECK(options.shard_group_size() >= 0, "fsdp: shard_group_size must be >= 0 (0: ranks per machine), got ",
              options.shard_group_size());
  // HYBRID_SHARD: gathers and reductions run over the shard group.
  const int shard_n = hybrid ? (options.shard_group_size() > 0 ? options.shard_group_size() : pg.local_world_size())
                             : n;
  TORCH_CHECK(!hybrid || (shard_n >= 1 && n % shard_n == 0), "fsdp: HYBRID_SHARD on rank ", pg.rank(),
              ": shard_group_size ", shard_n, " must divide the world size ", n,
              "; set Options::shard_group_size (0 means ranks per machine, here ", pg.local_world_size(), ")");
  r.shard_group_size = shard_n;
  TORCH_CHECK(!options.reduce_group().defined() || options.reduce_group().size() == shard_n,
              "fsdp: reduce_group has ", options.reduce_group().defined() ? options.reduce_group().size() : 0,
              " ranks but the sharding group has ", shard_n, "; they must cover the same ranks");
  // The gradient average is over the whole world (shard group x replica group).
  const double pre = options.gradient_predivide_factor();
  TORCH_CHECK(pre == 0 || (pre >= 1 && pre <= n), "fsdp: gradient_predivide_factor must lie in [1, world size ",
              n, "] (or be 0 for PyTorch's default), got ", pre);
  r.divide = gradient_division(pre, n);
  r.bucket_cap_bytes = bucket_cap_bytes(options);  // throws for a NaN, infinite or huge bucket_cap_mb
  r.reshard_after_forward = options.reshard_after_forward().value_or(
      strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard);
  r.strategy = strategy;
  r.reduce_group = options.reduce_group();
  r.limit_all_gathers = options.limit_all_gathers();
  r.forward_prefetch = options.forward_prefetch();
  r.backward_prefetch = options.backward_prefetch();
  r.mixed_precision = options.mixed_precision();
  r.keep_freed_host_memory = options.keep_freed_host_memory() && !malloc_tuned_by_environment();
  r.optimizer_in_backward = options.optimizer_in_backward();
  r.cpu_offload = options.cpu_offload();
  r.zero_copy_gather = options.zero_copy_gather();
  TORCH_CHECK(!r.zero_copy_gather || !r.cpu_offload, "fsdp (rank ", pg.rank(), "): zero_copy_gather maps the "
              "peers' shards into the gathered parameters, but cpu_offload keeps the shards away from the "
              "compute device; drop one of the two");
  TORCH_CHECK(!r.zero_copy_gather || !r.mixed_precision.param_dtype(), "fsdp (rank ", pg.rank(), "): "
              "zero_copy_gather maps the peers' shards as they are, but MixedPrecision::param_dtype gathers a cast "
              "copy of them; drop param_dtype (reduce_dtype is fine) or zero_copy_gather");
  r.gpu_margin_mem_ratio = checked_margin_ratio(options, pg.rank());
  r.trace_dir = options.trace_dir();
  if (r.trace_dir.empty())
    if (const char* env = std::getenv("FSDP_TRACE")) r.trace_dir = env;
  return r;
}

}  // namespace core::detail

WrapPolicy size_based_policy(int64_t min_num_params) {
  TORCH_CHECK(min_num_params >= 0, "fsdp: size_based_policy min_num_params must be >= 0, got ",
              min_num_params);
  return [min_num_params](const std::string&, const torch::nn::Module&, int64_t n) {
    return n >= min_num_params && n > 0;
  };
}

WrapPolicy always_wrap_policy() {
  return [](const std::string&, const torch::nn::Module&, int64_t) { return true; };
}

WrapPolicy path_policy(std::vector<std::string> paths) {
  return core::detail::PathPolicy{std::move(paths)};
}

}  // namespace fsdp
