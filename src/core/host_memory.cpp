#include "fsdp/core/host_memory.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <c10/util/Exception.h>

namespace fsdp {

bool keep_freed_host_memory(const HostMemoryPolicy& policy) {
  TORCH_CHECK(policy.mmap_threshold_bytes > 0 && policy.mmap_threshold_bytes <= (int64_t(32) << 20),
              "fsdp: keep_freed_host_memory: mmap_threshold_bytes must lie in (0, 32 MiB] "
              "(glibc's maximum), got ", policy.mmap_threshold_bytes);
  TORCH_CHECK(policy.trim_threshold_bytes > 0, "fsdp: keep_freed_host_memory: trim_threshold_bytes must be "
              "positive, got ", policy.trim_threshold_bytes);
#if defined(__GLIBC__)
  static std::mutex mu;
  static bool applied = false;
  std::lock_guard<std::mutex> lock(mu);
  if (applied) return true;
  // Setting either disables glibc's dynamic thresholds, so both are set.
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(policy.mmap_threshold_bytes)) != 1) return false;
  const int64_t trim = std::min<int64_t>(policy.trim_threshold_bytes, int64_t(1) << 30);
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim)) != 1) return false;
  applied = true;
  return true;
#else
  (void)policy;
  return false;
#endif
}

bool malloc_tuned_by_environment() {
  for (const char* var : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"})
    if (std::getenv(var) != nullptr) return true;
  return false;
}

}  // namespace fsdp
