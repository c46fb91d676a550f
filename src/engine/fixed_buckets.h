#pragma once
// Buckets of fixed members whose gradients arrive in any order and are reduced in bucket
// order: ZeRO-2's (the layout's buckets, [Note: ZeRO-2 gradient buckets] in
// src/optim/zero_bucket_reducer.h), as PyTorch DDP's reducer fills its buckets. FSDP's
// buckets form as units arrive in the reduction order instead (bucket_former.h).
//
// [Note: fixed buckets]
// A bucket's states, in one backward:
//   kEmpty     no member arrived yet (no buffer)
//   kFilling   buffer allocated, some members arrived
//   kReady     every member arrived (or the end of backward filled the rest with zeros)
//   kReducing  its collective is in flight
//   kEmpty     again once the reduction completed
// Ready buckets are issued in bucket order (the same on every rank, whatever order the
// gradients arrive in): a bucket that fills early waits for the ones before it. At the end
// of backward every bucket not issued yet becomes ready, with zeros for the members that got
// no gradient on this rank (an unused branch), so every rank issues every bucket once per
// backward, in the same order. A member's gradient is copied into its range of the bucket's
// buffer (in the buffer's dtype), so the caller may free it at once.
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "memory/buffer_pool.h"

namespace fsdp::engine {

class FixedBuckets {
 public:
  enum class State { kEmpty, kFilling, kReady, kReducing };
  struct Member {
    int bucket = 0;
    int64_t offset = 0;  // first element inside its bucket's buffer
    int64_t numel = 0;
  };
  struct Shape {
    int first_member = 0;  // members [first_member, end_member), consecutive
    int end_member = 0;
    int64_t numel = 0;     // the members' elements
    int64_t padded = 0;    // the buffer's (the tail beyond numel is zeros)
  };
  /// Buffers come from `allocate_block`'s memory through a pool that keeps up to `max_idle`
  /// freed ones for the next backward ([Note: buffer pool] in src/memory/buffer_pool.h).
  FixedBuckets(std::vector<Member> members, std::vector<Shape> buckets, int max_idle,
               std::function<at::DataPtr(size_t)> allocate_block);

  size_t size() const { return buckets_.size(); }
  State state(size_t b) const { return buckets_[b].state; }
  /// Member i's gradient arrived in this backward, and its bucket is not reduced yet.
  bool arrived(size_t i) const { return arrived_[i] != 0; }
  /// Member i's gradient, copied into its bucket's buffer (allocated with `options`, the
  /// communication dtype, at the bucket's first arrival). The bucket must be filling or
  /// empty and i not arrived.
  void arrive(size_t i, const at::Tensor& grad, const at::TensorOptions& options);
  /// The next bucket in order if it is ready, now reducing; nullopt otherwise.
  std::optional<size_t> next_ready();
  /// End of backward: every bucket not issued yet becomes ready, zeros for its members that
  /// did not arrive.
  void fill_rest(const at::TensorOptions& options);
  /// Bucket b's reduction completed: its buffer goes back to the pool, it is empty again.
  void reduced(size_t b);
  /// The next backward issues from the first bucket again.
  void restart() { next_issue_ = 0; }

  const at::Tensor& buffer(size_t b) const { return buckets_[b].buffer; }
  const Shape& shape(size_t b) const { return shapes_[b]; }
  /// Buffers alive, and the freed ones the pool keeps (and releasing those).
  int64_t bytes() const;
  int64_t idle_bytes() const { return pool_.idle_bytes(); }
  void release_idle() { pool_.release_idle(); }

 private:
  struct Bucket {
    State state = State::kEmpty;
    int arrived = 0;
    at::Tensor buffer;
  };
  void transition(size_t b, State to, const char* where);
  void allocate(size_t b, const at::TensorOptions& options);

  std::vector<Member> members_;
  std::vector<Shape> shapes_;
  std::vector<Bucket> buckets_;
  std::vector<uint8_t> arrived_;  // per member, until its bucket is reduced
  size_t next_issue_ = 0;
  memory::BufferPool pool_;
};

/// "kEmpty", ... for messages.
const char* to_string(FixedBuckets::State s);

}  // namespace fsdp::engine
