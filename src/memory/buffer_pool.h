#pragma once
// Internal to src/core: the cache of FSDP's large per-iteration buffers.
//
// [Note: buffer pool]
// Every iteration allocates and frees the same large buffers: each unit's
// unsharded parameters (twice under FULL_SHARD: forward and backward) and its
// flat gradient. On the GPU the caching allocator hands such blocks back at no
// cost; on the CPU they go to glibc, which serves blocks of this size with
// fresh mmaps or trims them off the heap once freed, so each one is
// page-faulted in again on every use. Measured on the 2-core VM (MLP
// 784-1024-1024-10, 2 ranks): ~1,100 page faults per rank per step, and worse,
// faults taken by Gloo's transport thread while receiving into a fresh buffer
// serialise with the main thread's own allocations (mmap lock), so a
// collective issued ahead of compute made no progress during it.
//
// The pool keeps a few freed blocks and hands them out again:
//   - a request takes the smallest idle block that holds it and is less than
//     twice its size (so a small unit never pins a large block), else a new
//     block of exactly the requested size;
//   - a freed block is kept if fewer than max_idle blocks are idle, else
//     released; blocks below min_block_bytes from the CPU allocator are never
//     kept (glibc reuses those from its heap without faults). Blocks from a
//     block allocator are kept whatever their size: the exchange arena reserves
//     a block's pages when it hands it out and punches them out when it is
//     freed, so a small block freed every step cost two syscalls and a page
//     fault per page on this rank and on every peer reading it (the mlp's
//     41 KB last unit: twice per step before this).
// Idle blocks are FSDP memory too: MemoryStats::cached_bytes reports them and
// FullyShardedBase::empty_cache() releases them (the CPU analogue of CUDA's
// reserved-but-unallocated memory). Leases outlive the pool safely: a block
// returned after the pool is gone is simply freed.
//
// New blocks come from the block allocator: the CPU allocator by default; the
// runtime sets comm::allocate_collective_buffer for its groups, so that on one host
// the peers read these buffers in place ([Note: exchange arena] in
// src/comm/shm/shm_arena.cpp). Blocks on a GPU come from the device's caching
// allocator: it has no faults to avoid, but a block kept here is reused without it, so
// whoever reuses one must order the streams ([Note: stream order] in
// src/core/stream_order.h), and every stream that may use a block must be known to the
// allocator before the block goes back to it (the new-block observer).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include <ATen/ATen.h>

namespace fsdp::memory {

class BufferPool {
 public:
  BufferPool(int max_idle, int64_t min_block_bytes);

  /// Memory for at least `nbytes` bytes on `device`; freeing the DataPtr returns it here.
  at::DataPtr allocate(size_t nbytes, at::Device device = at::kCPU);
  /// A 1-D tensor of `numel` elements of `options` on pooled memory (contents undefined).
  at::Tensor empty(int64_t numel, const at::TensorOptions& options);

  /// Where new host blocks come from (set before the first allocation); device blocks
  /// come from the device's own allocator.
  void set_block_allocator(std::function<at::DataPtr(size_t)> allocate_block);
  /// Called with every new block, host or device, before it is handed out.
  void set_new_block_observer(std::function<void(const at::DataPtr&)> observer);

  /// Bytes of idle blocks held, and releasing them.
  int64_t idle_bytes() const;
  void release_idle();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace fsdp::memory
