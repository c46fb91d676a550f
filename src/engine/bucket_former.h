#pragma once
// Who joins the open bucket when flat gradients arrive one at a time in the reduction order
// (FSDP's units, [Note: reduce buckets] in src/core/grad_reducer.h): the arithmetic of
// sizes, kinds and a cap. A bucket of fixed members filled in any order is FixedBuckets
// (fixed_buckets.h).
#include <cstdint>
#include <optional>

#include <ATen/ATen.h>

namespace fsdp::engine {

/// A flat gradient (a unit's) as bucket formation sees it.
struct BucketCandidate {
  int64_t bytes = 0;     // padded flat gradient, in reduce dtype
  bool sharded = true;   // reduce-scatter (N rows) or all-reduce (one row)
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
};

/// Who joins the open bucket ([Note: reduce buckets], "Who joins"): sizes,
/// kinds and the cap only; knows nothing of units or collectives.
class BucketFormer {
 public:
  explicit BucketFormer(int64_t cap_bytes) : cap_bytes_(cap_bytes) {}
  /// Never shares a bucket (every candidate when the cap is <= 0).
  bool alone(const BucketCandidate& c) const { return cap_bytes_ <= 0 || c.bytes >= cap_bytes_; }
  /// May join the open bucket without issuing it first.
  bool fits(const BucketCandidate& c) const;
  /// Adding c will issue a collective.
  bool issues_on_join(const BucketCandidate& c) const { return alone(c) || !fits(c); }
  /// c joins: close_before: the open bucket (without c) is issued before c
  /// joins; close_after: the bucket holding c is issued at once.
  struct Join {
    bool close_before = false;
    bool close_after = false;
  };
  Join join(const BucketCandidate& c);
  /// The open bucket was issued (end of backward).
  void clear();
  bool empty() const { return !first_; }
  int64_t open_bytes() const { return open_bytes_; }

 private:
  int64_t cap_bytes_;
  std::optional<BucketCandidate> first_;  // the open bucket's first member
  int64_t open_bytes_ = 0;
};

}  // namespace fsdp::engine
