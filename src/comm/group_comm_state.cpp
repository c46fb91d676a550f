// See [Note: per-group comm state] in group_comm_state.h.
#include "group_comm_state.h"

#include <atomic>

#include <ATen/ATen.h>

namespace fsdp::comm::detail {

namespace {

// Sum of every live GroupCommState's idle buffer (comm_cached_bytes()).
std::atomic<int64_t> g_cached_bytes{0};

// Tensor::nbytes(), and 0 for the undefined (leased or never cached) idle buffer.
int64_t defined_nbytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

}  // namespace

GroupCommState::~GroupCommState() { g_cached_bytes -= defined_nbytes(idle_); }

int GroupCommState::reserve_tags(int count) {
  std::lock_guard<std::mutex> lock(mu_);
  // Gloo wants tags >= 0; wrap well below INT_MAX. Tags of finished calls are free
  // again long before the counter comes back to them.
  constexpr uint32_t kWrap = 1u << 30;
  if (next_tag_ + static_cast<uint32_t>(count) >= kWrap) next_tag_ = 0;
  const int first = static_cast<int>(next_tag_);
  next_tag_ += static_cast<uint32_t>(count);
  return first;
}

at::Tensor GroupCommState::acquire_scratch(int64_t bytes) {
  if (bytes >= kCacheMinBytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (defined_nbytes(idle_) >= bytes) {
      g_cached_bytes -= defined_nbytes(idle_);
      return std::move(idle_);  // leaves idle_ undefined: leased
    }
  }
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
}

void GroupCommState::release_scratch(at::Tensor buffer) {
  if (defined_nbytes(buffer) < kCacheMinBytes) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (defined_nbytes(idle_) < defined_nbytes(buffer)) {
    g_cached_bytes += defined_nbytes(buffer) - defined_nbytes(idle_);
    idle_ = std::move(buffer);
  }
}

int64_t GroupCommState::cached_bytes() { return g_cached_bytes.load(); }

}  // namespace fsdp::comm::detail
