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
//   - reduce-scatter's receive buffer, when it is large. Below kCacheMinBytes the
//     allocator reuses a freed block for the next call at no cost; above it glibc
//     mmaps a fresh mapping and page-faults it in on every call (~100 ms for 64 MiB
//     on the shared VM), which cost more than the transfer. So large buffers are
//     leased: acquire_scratch takes the group's idle buffer if it is big enough,
//     release_scratch gives it back (the group keeps one idle buffer, the largest).
//     A second call in flight on the same group finds no idle buffer and allocates
//     its own. Small buffers are never kept, so FSDP's model-state accounting is
//     unchanged for units below kCacheMinBytes.
// Entries are keyed by the c10d group and hold it weakly; entries of dead groups
// (and their buffers) are dropped on the next call into this registry.
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "fsdp/dist/process_group.h"

namespace fsdp::dist::detail {

/// Receive buffers of at least this many bytes are kept per group between calls.
constexpr int64_t kCacheMinBytes = int64_t(8) << 20;

/// First of `count` consecutive message tags reserved for one call on `g`.
int reserve_tags(const ProcessGroup& g, int count);

/// A contiguous 1-D buffer of at least `numel` elements of `options` (the group's idle
/// buffer or a new one). Pass it back to release_scratch once no message uses it.
at::Tensor acquire_scratch(const ProcessGroup& g, int64_t numel, const at::TensorOptions& options);
void release_scratch(const ProcessGroup& g, at::Tensor buffer);

/// Bytes of idle receive buffers currently kept, over all live groups (tests).
int64_t cached_scratch_bytes();

}  // namespace fsdp::dist::detail
