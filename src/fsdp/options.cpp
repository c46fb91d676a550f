#include "fsdp/fsdp/options.h"

#include <algorithm>
#include <cctype>
#include <cmath>

namespace fsdp {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD: return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD: return "HYBRID_SHARD";
  }
  return "?";
}

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "full_shard") return ShardingStrategy::FULL_SHARD;
  if (n == "shard_grad_op") return ShardingStrategy::SHARD_GRAD_OP;
  if (n == "no_shard") return ShardingStrategy::NO_SHARD;
  if (n == "hybrid_shard") return ShardingStrategy::HYBRID_SHARD;
  TORCH_CHECK(false, "fsdp: unknown sharding strategy '", name,
              "'; expected one of full_shard, shard_grad_op, no_shard, hybrid_shard");
}

const char* to_string(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::NONE: return "NONE";
    case BackwardPrefetch::BACKWARD_PRE: return "BACKWARD_PRE";
    case BackwardPrefetch::BACKWARD_POST: return "BACKWARD_POST";
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
  return [paths = std::move(paths)](const std::string& path, const torch::nn::Module&, int64_t) {
    return std::find(paths.begin(), paths.end(), path) != paths.end();
  };
}

}  // namespace fsdp
