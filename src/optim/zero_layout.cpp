#include "zero_layout.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace fsdp::optim::detail {

ZeroLayout::ZeroLayout(const std::vector<int64_t>& numels, int world_size, int64_t bucket_cap)
    : world_size_(world_size) {
  TORCH_INTERNAL_ASSERT(world_size > 0 && bucket_cap > 0);
  const int n = static_cast<int>(numels.size());
  params_.resize(n);
  int first = 0;
  int64_t open = 0;  // elements of the open bucket [first, i)
  auto close = [&](int end) {
    ZeroBucket b;
    b.first_param = first;
    b.end_param = end;
    b.flat_offset = flat_numel_;
    b.numel = open;
    b.padded = (open + world_size - 1) / world_size * world_size;
    b.chunk = b.padded / world_size;
    b.local_offset = partition_numel_;
    int64_t at = 0;
    for (int i = first; i < end; ++i) {
      params_[i].bucket = static_cast<int>(buckets_.size());
      params_[i].bucket_offset = at;
      params_[i].flat_offset = b.flat_offset + at;
      params_[i].numel = numels[i];
      at += numels[i];
    }
    flat_numel_ += b.padded;
    partition_numel_ += b.chunk;
    buckets_.push_back(b);
    first = end;
    open = 0;
  };
  for (int i = 0; i < n; ++i) {
    TORCH_INTERNAL_ASSERT(numels[i] >= 0);
    if (i > first && open + numels[i] > bucket_cap) close(i);
    open += numels[i];
  }
  if (n > first) close(n);
}

int64_t ZeroLayout::chunk_offset(int bucket, int rank) const {
  const ZeroBucket& b = buckets_.at(bucket);
  return b.flat_offset + rank * b.chunk;
}

std::vector<ZeroPiece> ZeroLayout::pieces(int rank) const {
  TORCH_INTERNAL_ASSERT(rank >= 0 && rank < world_size_);
  std::vector<ZeroPiece> out;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const ZeroBucket& b = buckets_[bi];
    const int64_t lo = b.flat_offset + rank * b.chunk, hi = lo + b.chunk;
    for (int i = b.first_param; i < b.end_param; ++i) {
      const ZeroParamSlot& p = params_[i];
      const int64_t s = std::max(lo, p.flat_offset), e = std::min(hi, p.flat_offset + p.numel);
      if (s >= e) continue;
      ZeroPiece piece;
      piece.param = i;
      piece.param_offset = s - p.flat_offset;
      piece.numel = e - s;
      piece.flat_offset = s;
      piece.local_offset = b.local_offset + (s - lo);
      out.push_back(piece);
    }
  }
  return out;
}

}  // namespace fsdp::optim::detail
