#include "fixed_buckets.h"

#include <utility>

namespace fsdp::engine {

const char* to_string(FixedBuckets::State s) {
  switch (s) {
    case FixedBuckets::State::kEmpty: return "EMPTY";
    case FixedBuckets::State::kFilling: return "FILLING";
    case FixedBuckets::State::kReady: return "READY";
    case FixedBuckets::State::kReducing: return "REDUCING";
  }
  return "?";
}

FixedBuckets::FixedBuckets(std::vector<Member> members, std::vector<Shape> buckets, int max_idle,
                           std::function<at::DataPtr(size_t)> allocate_block)
    : members_(std::move(members)), shapes_(std::move(buckets)), buckets_(shapes_.size()),
      arrived_(members_.size(), 0), pool_(max_idle, /*min_block_bytes=*/0) {
  pool_.set_block_allocator(std::move(allocate_block));
}

void FixedBuckets::transition(size_t b, State to, const char* where) {
  Bucket& k = buckets_[b];
  const State from = k.state;
  const bool ok = (from == State::kEmpty && (to == State::kFilling || to == State::kReady)) ||
                  (from == State::kFilling && to == State::kReady) ||
                  (from == State::kReady && to == State::kReducing) ||
                  (from == State::kReducing && to == State::kEmpty);
  TORCH_INTERNAL_ASSERT(ok, "bucket ", b, " cannot go from ", to_string(from), " to ", to_string(to), " in ", where);
  k.state = to;
}

void FixedBuckets::allocate(size_t b, const at::TensorOptions& options) {
  const Shape& s = shapes_[b];
  buckets_[b].buffer = pool_.empty(s.padded, options);
}

void FixedBuckets::arrive(size_t i, const at::Tensor& grad, const at::TensorOptions& options) {
  const Member& m = members_[i];
  const size_t b = static_cast<size_t>(m.bucket);
  Bucket& k = buckets_[b];
  TORCH_INTERNAL_ASSERT(!arrived_[i] && (k.state == State::kEmpty || k.state == State::kFilling));
  const Shape& s = shapes_[b];
  if (k.state == State::kEmpty) {
    allocate(b, options);
    if (s.padded > s.numel) k.buffer.narrow(0, s.numel, s.padded - s.numel).zero_();
    transition(b, State::kFilling, "arrive");
  }
  k.buffer.narrow(0, m.offset, m.numel).copy_(grad.reshape({-1}));
  arrived_[i] = 1;
  if (++k.arrived == s.end_member - s.first_member) transition(b, State::kReady, "arrive");
}

std::optional<size_t> FixedBuckets::next_ready() {
  if (next_issue_ >= buckets_.size() || buckets_[next_issue_].state != State::kReady) return std::nullopt;
  transition(next_issue_, State::kReducing, "next_ready");
  return next_issue_++;
}

void FixedBuckets::fill_rest(const at::TensorOptions& options) {
  for (size_t b = next_issue_; b < buckets_.size(); ++b) {
    Bucket& k = buckets_[b];
    const Shape& s = shapes_[b];
    if (k.state == State::kEmpty) {
      allocate(b, options);
      k.buffer.zero_();
    } else if (k.state == State::kFilling) {
      for (int i = s.first_member; i < s.end_member; ++i)
        if (!arrived_[i]) k.buffer.narrow(0, members_[i].offset, members_[i].numel).zero_();
    }
    if (k.state != State::kReady) transition(b, State::kReady, "fill_rest");
  }
}

void FixedBuckets::reduced(size_t b) {
  Bucket& k = buckets_[b];
  const Shape& s = shapes_[b];
  k.buffer = at::Tensor();
  k.arrived = 0;
  for (int i = s.first_member; i < s.end_member; ++i) arrived_[i] = 0;
  transition(b, State::kEmpty, "reduced");
}

int64_t FixedBuckets::bytes() const {
  int64_t n = 0;
  for (const Bucket& k : buckets_)
    if (k.buffer.defined()) n += static_cast<int64_t>(k.buffer.nbytes());
  return n;
}

}  // namespace fsdp::engine
