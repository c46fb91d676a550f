#pragma once
// A copy-on-write snapshot of memory regions: what an asynchronous checkpoint writes while
// training goes on.
//
// [Note: copy-on-write snapshots]
// Training must not stop while a checkpoint is written. At a step boundary the training
// thread snapshots some regions (parameter shards, optimizer state); a writer thread then
// writes those bytes to disk while training overwrites them. Words used below: a *page* is
// the system's page; a *chunk* is the writer's unit (chunk_bytes, 1 MiB by default): it
// takes a chunk's pages, hands them to its writev, and gives them back; the *side buffer*
// holds the pages training wrote before the writer took them.
//
// The protocol. The constructor makes every region read-only (mprotect PROT_READ): that is
// the training thread's whole stall. Each page is then in one state (cow_snapshot.cpp):
// protected; being copied; copied to a side slot; being taken (its chunk is in the writer's
// hands); taken. A write by training to a protected page faults (SIGSEGV); the handler copies
// the page, and the protected pages after it up to its chunk's end, into the next side slots,
// makes them writable and returns, so the write goes on. (Training writes a tensor front to
// back: one fault per chunk, not one per page, each a signal and an mprotect.) The writer's
// take() claims a chunk's pages, points its iovecs at the original page or at the page's
// side copy, calls the caller's function (a CRC and a write straight from them: no copy of
// its own), then makes the pages writable and marks them taken. A fault on a page that is
// being taken waits for that chunk's write to end (at most one chunk: take() works chunk by
// chunk); a fault on a taken page just returns.
//
// Why the waits are bounded. The side buffer is fixed (copy_cap_bytes, mapped up front: the
// handler never allocates), and each of its slots is used once. When it is full, a fault
// waits until the writer takes that page.
// The writer never waits for training (only for the few microseconds a handler holds a page
// it is copying, which is a memcpy and an mprotect with no wait inside), so every wait of
// training ends once the writer reaches the page, or once release() gives every page back.
// A writer that writes into a snapshotted region itself would wait for itself: it must not.
//
// Why not fork(). A forked child sees the parent's private pages as they were, for free, but
// (1) it gets no snapshot of MAP_SHARED memory: the shared-memory exchange arena
// ([Note: exchange arena] in src/comm/shm/shm_arena.cpp), which peers write, goes on
// changing under it; and (2) fork() in a threaded process keeps only the forking thread:
// locks held by the others (the allocator's, Gloo's, the CUDA runtime's) stay locked in the
// child forever. Page protection is per process and per mapping, which brings its own
// limits, each a rule for what may be snapshotted this way:
//   - pages a peer process writes through its own mapping of shared memory cannot be
//     protected from here: such state takes a staged copy instead;
//   - a kernel write into a protected page (read(), recv(), io_uring) does not fault, it
//     fails with EFAULT: only state this process's user-space code writes may live in a
//     protected mapping ([Note: page mappings] in page_mapping.h), never a receive buffer
//     (test_cow_snapshot checks the EFAULT);
//   - DMA (a GPU copying into pinned host memory, RDMA) bypasses page protection entirely:
//     device-written memory takes the staged path too.
// userfaultfd's write-protect mode would deliver the faults to a thread of ours instead of a
// signal handler, but it needs UFFD_USER_MODE_ONLY on kernels with
// vm.unprivileged_userfaultfd=0 and Linux >= 5.11, and a fallback wherever it is refused.
// mprotect and SIGSEGV need nothing, which is why they are used. The handler is installed
// once (sigaction, SA_SIGINFO) and chains every fault that is not a write to a page of a live
// snapshot to the handler it found (SIG_DFL, SIG_IGN, a handler or a sigaction), so an
// ordinary crash crashes as before. A program that installs its own SIGSEGV handler after
// ours cuts the chain: a later snapshot then refuses to start, with that reason.
//
// Costs. A fault costs a signal, a copy of the rest of its chunk and an mprotect. The
// snapshot pays off when the writer takes most pages before training writes them again; a
// region training rewrites at once, faster than the writer goes, costs more than copying it
// whole at the step boundary would. A 4 KiB mprotect
// inside a transparent huge page splits its mapping into small pages (until khugepaged
// collapses them again). Each run of pages whose protection differs from its
// neighbours' is a kernel mapping (VMA) of its own until the snapshot is released, and a
// process may hold vm.max_map_count of them (65530 by default): a region written in a
// scattered order while the writer is slow is the worst case; sequential writes and chunk
// takes merge back. A handler that cannot change a page's protection cannot recover: it says
// so on stderr and aborts.
//
// Lifetime. Up to kMaxLiveSnapshots are alive at once (a process-wide registry of atomics
// the handler reads). release() gives back every page not yet taken and unregisters, waiting
// for handlers still inside; a fault already raised by the hardware on a page release() has
// just given back finds no snapshot, and is retried for up to a second rather than chained as
// a crash.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "page_mapping.h"

struct iovec;

namespace fsdp::memory {

/// Page-aligned memory to snapshot: inside a PageMapping, written only by this process's code.
struct CowRegion {
  void* base = nullptr;
  size_t bytes = 0;
};

struct CowOptions {
  /// Bound on the side buffer: pages training writes before the writer took them, copied
  /// (rounded down to whole pages). 0: training waits for the writer on every such page.
  size_t copy_cap_bytes = size_t{64} << 20;
  /// The writer's unit: a multiple of the page size, at most IOV_MAX pages (so that one
  /// chunk's iovecs fit one writev).
  size_t chunk_bytes = size_t{1} << 20;
};

struct CowStats {
  int64_t pages_copied = 0;  ///< pages training wrote before the writer took them
  int64_t copy_bytes = 0;    ///< their bytes, in the side buffer
  int64_t faults = 0;        ///< write faults on this snapshot's pages
  int64_t fault_ns = 0;      ///< time training threads spent in the handler for them
  int64_t wait_ns = 0;       ///< of fault_ns: waiting (for the writer's chunk, a copy, or room)
  int64_t protect_ns = 0;    ///< time of the constructor's mprotect calls (training's stall)
};

class CowSnapshot {
 public:
  /// Process-wide: the handler's registry is a fixed array.
  static constexpr int kMaxLiveSnapshots = 4;
  /// What take() hands a chunk's bytes to: `n` iovecs, in order, valid during the call.
  using ChunkFn = std::function<void(const struct iovec* iov, int n)>;

  /// At a step boundary, on the training thread: protects `regions` (page-aligned, disjoint,
  /// each inside a PageMapping and writable). Throws std::invalid_argument for bad regions or
  /// options, std::runtime_error when the kernel refuses or kMaxLiveSnapshots are alive.
  CowSnapshot(std::vector<CowRegion> regions, CowOptions options = {});
  /// release().
  ~CowSnapshot();
  CowSnapshot(const CowSnapshot&) = delete;
  CowSnapshot& operator=(const CowSnapshot&) = delete;

  /// The writer: `bytes` at `offset` of region `region` (as given to the constructor; page
  /// multiples), chunk by chunk (chunks start at multiples of chunk_bytes in the region): fn
  /// gets each chunk's bytes as they were at the snapshot, then its pages are the training
  /// thread's again. Any order; each page at most once (again: std::logic_error). One writer
  /// thread, or threads taking disjoint ranges; fn must not write a snapshotted region (it
  /// would wait for itself). If fn throws, that chunk's pages are given back as if taken and
  /// the exception propagates.
  void take(size_t region, size_t offset, size_t bytes, const ChunkFn& fn);

  /// Gives back every page not taken yet and unregisters; any thread, idempotent. A training
  /// thread waiting for a page (side buffer full) goes on; a chunk in the writer's hands is
  /// waited for. After it, no fault of this snapshot can occur and take() throws.
  void release();

  /// Readable any time, from any thread.
  CowStats stats() const;
  size_t region_count() const { return regions_.size(); }
  size_t chunk_bytes() const { return chunk_bytes_; }

 private:
  friend struct CowFaultHandler;
  struct Range;  // one chunk's pages, claimed by the writer

  void index_regions();
  void protect_regions();
  void check_take(size_t region, size_t offset, size_t bytes) const;
  void take_chunk(Range& range, const ChunkFn& fn);
  uint32_t claim_page(size_t page);
  void give_back_chunk(const Range& range);
  void give_back_all();

  /// The signal handler's entry: true when `addr` is in a page of this snapshot (the write
  /// may be retried on return); waits as [Note: copy-on-write snapshots] says.
  bool on_write_fault(const void* addr) noexcept;
  void resolve_fault(size_t page, char* addr, size_t limit) noexcept;
  size_t claim_run(size_t page, size_t limit) noexcept;
  size_t reserve_slots(size_t wanted, size_t* slot) noexcept;
  void copy_pages(size_t page, char* addr, size_t count, size_t slot) noexcept;

  std::vector<CowRegion> regions_;          // as given
  std::vector<size_t> first_page_;          // regions_[i]'s first page in pages_
  std::vector<size_t> by_address_;          // indices of regions_, by base address
  size_t page_ = 0;
  size_t chunk_bytes_ = 0;
  size_t page_count_ = 0;
  std::unique_ptr<std::atomic<uint32_t>[]> pages_;  // page states (cow_snapshot.cpp)
  PageMapping side_;
  size_t side_slots_ = 0;
  std::atomic<size_t> next_slot_{0};
  int registry_slot_ = -1;
  std::atomic<bool> released_{false};

  std::atomic<int64_t> pages_copied_{0};
  std::atomic<int64_t> faults_{0};
  std::atomic<int64_t> fault_ns_{0};
  std::atomic<int64_t> wait_ns_{0};
  std::atomic<int64_t> protect_ns_{0};
};

}  // namespace fsdp::memory
