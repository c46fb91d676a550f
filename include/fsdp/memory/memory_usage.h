#pragma once
// Bytes one rank holds, by what they are for. One type shared by the sharded optimizer's
// get_memory_usage() and the memory tracer, so that both report the
// same categories and a user adds them up the same way. Counting is the producer's business
// (tensor storage sizes, or the allocator); this is only the vocabulary.
#include <cstdint>
#include <string>

namespace fsdp {

enum class MemoryCategory : int {
  kParameterShards = 0,   // this rank's shard of the parameters (or its replica, unsharded)
  kUnshardedParameters,   // gathered full parameters alive at the moment of the sample
  kGradients,             // gradients (full or this rank's partition)
  kMasterWeights,         // fp32 master copies kept next to low-precision parameters
  kOptimizerState,        // Adam moments, momentum buffers, step counters
  kOther,                 // activations and temporaries: what the allocator holds beyond the above
};
constexpr int kNumMemoryCategories = 6;

// Stable names, used as JSON keys.
constexpr const char* memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::kParameterShards: return "parameter_shards";
    case MemoryCategory::kUnshardedParameters: return "unsharded_parameters";
    case MemoryCategory::kGradients: return "gradients";
    case MemoryCategory::kMasterWeights: return "master_weights";
    case MemoryCategory::kOptimizerState: return "optimizer_state";
    case MemoryCategory::kOther: return "other";
  }
  return "unknown";
}

struct MemoryUsage {
  std::string device = "cpu";
  int64_t bytes[kNumMemoryCategories] = {};
  /// Of total(), the bytes in host memory away from `device` because of offload
  /// (ZeroOptions::cpu_offload); 0 without it.
  int64_t offloaded_bytes = 0;

  int64_t& operator[](MemoryCategory c) { return bytes[static_cast<int>(c)]; }
  int64_t operator[](MemoryCategory c) const { return bytes[static_cast<int>(c)]; }
  int64_t total() const {
    int64_t sum = 0;
    for (int64_t b : bytes) sum += b;
    return sum;
  }
};

}  // namespace fsdp
