#pragma once
/// Host (CPU) memory policy for training processes.
///
/// [Note: freed host memory]
/// A training step frees and re-allocates the same multi-megabyte tensors every
/// iteration: autograd's weight gradients, FSDP's gathered parameters and flat
/// gradients, Gloo's receive buffers. glibc serves blocks above its mmap
/// threshold with fresh mmaps and trims freed memory at the top of its heap
/// back to the OS, so each of those tensors is page-faulted in again on every
/// step; and a page fault taken by Gloo's transport thread while receiving waits
/// on the mmap lock held by the main thread's own mmaps, so a collective issued
/// ahead of compute stalls. Measured on the 2-core VM (MLP 784-1024-1024-10, two
/// ranks, NO_SHARD): ~1,300 faults per rank per step and ~3 ms of a ~30 ms step;
/// Python's DDP process happens to keep its heap (4 faults per step).
///
/// keep_freed_host_memory() raises glibc's mmap threshold and trim threshold, so
/// freed blocks stay in the heap and are reused without faults. The process's
/// resident set then stays at its high-water mark instead of shrinking between
/// steps (the bytes *allocated* are unchanged). FullyShardedDataParallel applies
/// it at construction unless Options::keep_freed_host_memory(false) or the user
/// chose their own malloc settings (malloc_tuned_by_environment(): read when the
/// options are resolved, like every other environment variable FSDP reads). It
/// does nothing on a C library other than glibc.

#include <cstdint>

namespace fsdp {

struct HostMemoryPolicy {
  /// Blocks of at least this size are mmapped (glibc's maximum is 32 MiB on 64-bit).
  int64_t mmap_threshold_bytes = int64_t(32) << 20;
  /// The heap's free top is returned to the OS only above this size.
  int64_t trim_threshold_bytes = int64_t(1) << 30;
};

/// Applies the policy once per process; returns whether it is in effect (false
/// when the C library is not glibc).
/// policy.trim_threshold_bytes above 1 GiB is silently applied as 1 GiB (mallopt
/// takes an int).
bool keep_freed_host_memory(const HostMemoryPolicy& policy = {});

/// Whether the environment sets malloc tunables (MALLOC_MMAP_THRESHOLD_,
/// MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES): the user's own settings, which win.
bool malloc_tuned_by_environment();

}  // namespace fsdp
