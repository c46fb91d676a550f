#pragma once
// Internal to src/comm: byte-level facts about dense tensors that several transports need.
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace fsdp::comm::detail {

/// `x` rounded up to a multiple of `m` (segment and arena block lengths to pages).
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

/// Whether the bytes of two contiguous tensors overlap.
inline bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + nbytes(b) && b0 < a0 + nbytes(a);
}

}  // namespace fsdp::comm::detail
