#include "bucket_former.h"

namespace fsdp::engine {

bool BucketFormer::fits(const BucketCandidate& c) const {
  if (!first_) return true;
  return c.sharded == first_->sharded && c.dtype == first_->dtype && c.device == first_->device &&
         open_bytes_ + c.bytes <= cap_bytes_;
}

BucketFormer::Join BucketFormer::join(const BucketCandidate& c) {
  Join j;
  if (!fits(c)) {
    j.close_before = true;
    clear();
  }
  if (!first_) first_ = c;
  open_bytes_ += c.bytes;
  if (alone(c)) {  // too big to share
    j.close_after = true;
    clear();
  }
  return j;
}

void BucketFormer::clear() {
  first_.reset();
  open_bytes_ = 0;
}

}  // namespace fsdp::engine
