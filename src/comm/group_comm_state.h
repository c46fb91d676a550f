#pragma once
// Internal to src/comm: the state that Gloo all-gathers and reduce-scatters built from
// point-to-point messages keep between calls on one group. Owned by the group's
// GlooTransport (gloo_transport.h), so it lives and dies with the group.
//
// [Note: per-group comm state]
// Two things outlive one call, and both belong to a group:
//   - message tags. Gloo matches a send to a recv by (peer, tag). Every call reserves
//     fresh tags from a per-group counter, so two calls in flight on the same group
//     cannot take each other's messages. Every rank issues a group's collectives in
//     the same order (the usual rule), so every rank reserves the same tags.
//   - scratch buffers, when they are large: reduce-scatter's receive buffer, and the
//     send buffer of the small-buffer all-gather (the shard repeated N times, see
//     [Note: point-to-point all-gather and reduce-scatter] in gloo_p2p.cpp). A fresh
//     buffer of a MiB or more is costly in two ways: above glibc's mmap threshold it is
//     mmapped and page-faulted in on every call (more than the transfer it overlaps for
//     large buffers), and below it the pages of a freshly grown heap still fault while
//     Gloo's loop thread writes into them and the caller's thread allocates (both take
//     the mmap lock), which doubled the wait of a 4 MiB reduce-scatter at N=2 in a probe.
//     So buffers of kCacheMinBytes or more are leased: acquire_scratch takes the group's
//     idle buffer if it is big enough, release_scratch gives it back, and the group keeps
//     one idle buffer, the largest so far. A second call in flight on the same group
//     finds no idle buffer and allocates its own.
//     Memory bound: per group, one buffer no larger than the largest flat buffer passed
//     to all_gather_into or reduce_scatter on it (reduce-scatter over point-to-point
//     needs (N-1)/N of it, the small-buffer paths all of it); comm_cached_bytes()
//     reports the total over live groups. FSDP's units below kCacheMinBytes keep nothing.
//     Buffers are untyped (bytes): one lease serves every dtype.
#include <cstdint>
#include <mutex>

#include <ATen/core/Tensor.h>

namespace fsdp::comm::detail {

/// Scratch buffers of at least this many bytes are kept per group between calls.
constexpr int64_t kCacheMinBytes = int64_t(1) << 20;

class GroupCommState {
 public:
  GroupCommState() = default;
  GroupCommState(const GroupCommState&) = delete;
  GroupCommState& operator=(const GroupCommState&) = delete;
  ~GroupCommState();  // frees the idle buffer and takes it out of cached_bytes()

  /// First of `count` consecutive message tags reserved for one call.
  int reserve_tags(int count);

  /// A contiguous 1-D kByte buffer of at least `bytes` bytes (the idle buffer or a new
  /// one), 64-byte aligned so any dtype may view it. Pass it back to release_scratch once
  /// no message uses it.
  at::Tensor acquire_scratch(int64_t bytes);
  void release_scratch(at::Tensor buffer);

  /// Bytes of idle scratch buffers kept by every live group of the process.
  static int64_t cached_bytes();

 private:
  std::mutex mu_;
  uint32_t next_tag_ = 0;
  at::Tensor idle_;  // undefined when leased out or never needed
};

}  // namespace fsdp::comm::detail
