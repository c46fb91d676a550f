#pragma once
// Host state moved onto pages of its own, so that a copy-on-write snapshot can protect it.
//
// [Note: state on pages of its own]
// A copy-on-write snapshot ([Note: copy-on-write snapshots] in cow_snapshot.h) protects whole
// pages, so the pages of the state it snapshots must hold nothing else: an allocation from
// glibc's heap shares its first and last pages with other objects (the allocator's own
// headers among them), and an unrelated write there, or a kernel write (read(), recv()) into
// a neighbour, would meet the protection. So prepare_async_checkpoint (or else the first
// asynchronous save) moves each plain host storage a save snapshots (a parameter shard, an
// optimizer-state tensor) into a PageMapping of its own, copying the bytes once: the
// storage's data pointer is swapped, as BufferPool's blocks are, so every tensor viewing the
// storage (the parameter, its views, the optimizer's state keyed by the parameter) follows
// without knowing. Only storages of the CPU allocator move: pinned memory is written by
// DMA, the exchange arena by peers, a pool's blocks are reused; those keep their memory, and
// a save copies them instead.

#include <ATen/core/Tensor.h>

#include "cow_snapshot.h"

namespace fsdp::memory {

/// Moves `t`'s whole storage onto pages of its own (same bytes) when it is a plain CPU
/// allocation, or finds it there already. Returns whether it is on pages of its own now.
bool move_to_own_pages(const at::Tensor& t);

/// The pages under `t`'s storage when they are its own (move_to_own_pages), else an empty
/// region.
CowRegion own_pages_of(const at::Tensor& t);

}  // namespace fsdp::memory
