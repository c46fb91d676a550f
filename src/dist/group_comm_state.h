#pragma once
// Internal to src/dist: per-group state of the collectives that collectives.cpp builds
// from point-to-point messages (all-gather, reduce-scatter).
//
// [Note: per-group comm state]
// Two things outlive one call, and both belong to a c10d group:
//   - message tags. Gloo matches a send to a recv by (peer, tag). Every call reserves
//     fresh tags from a per-group counter, so two calls in flight on the same group
//     cannot take each other's messages. Every rank issues a group's collectives in
//     the same order (the usual rule), so every rank reserves the same tags.
//   - scratch buffers, when they are large: reduce-scatter's receive buffer, and the
//     send buffer of the small-buffer all-gather (the shard repeated N times, see
//     [Note: point-to-point all-gather and reduce-scatter]). A fresh buffer of a MiB or
//     more is costly in two ways: above glibc's mmap threshold it is mmapped and
//     page-faulted in on every call (~100 ms for 64 MiB on the shared VM, more than the
//     transfer), and below it the pages of a freshly grown heap still fault while Gloo's
//     loop thread writes into them and the caller's thread allocates (both take the
//     mmap lock): a reduce-scatter of 4 MiB at N=2 (a 2 MiB receive buffer) issued before
//     3 ms of compute and waited after it waited 2.43 ms with a fresh buffer, 1.26 ms
//     with a kept one (a probe, 2026-11). So buffers of
//     kCacheMinBytes or more are leased: acquire_scratch takes the group's idle buffer
//     if it is big enough, release_scratch gives it back, and the group keeps one idle
//     buffer, the largest so far. A second call in flight on the same group finds no
//     idle buffer and allocates its own.
//     Memory bound: per group, one buffer no larger than the largest flat buffer passed
//     to all_gather_into or reduce_scatter on it (reduce-scatter over point-to-point
//     needs (N-1)/N of it, the small-buffer paths all of it); comm_cached_bytes()
//     reports the total. FSDP's units below kCacheMinBytes keep nothing.
//     Buffers are untyped (bytes): one lease serves every dtype.
// Entries are keyed by the c10d group and hold it weakly; entries of dead groups
// (and their buffers) are dropped on the next call into this registry.
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "fsdp/dist/process_group.h"

namespace fsdp::dist::detail {

/// Scratch buffers of at least this many bytes are kept per group between calls.
constexpr int64_t kCacheMinBytes = int64_t(1) << 20;

/// First of `count` consecutive message tags reserved for one call on `g`.
int reserve_tags(const ProcessGroup& g, int count);

/// A contiguous 1-D kByte buffer of at least `bytes` bytes (the group's idle buffer or a
/// new one), 64-byte aligned so any dtype may view it. Pass it back to release_scratch
/// once no message uses it.
at::Tensor acquire_scratch(const ProcessGroup& g, int64_t bytes);
void release_scratch(const ProcessGroup& g, at::Tensor buffer);

/// Bytes of idle scratch buffers currently kept, over all live groups (tests).
int64_t cached_scratch_bytes();

}  // namespace fsdp::dist::detail
