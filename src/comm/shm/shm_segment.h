#pragma once
// Internal to src/comm: one rank's shared-memory segment, as it lies in /dev/shm and in the
// address space of every member that maps it ([Note: shared-memory transport] in
// shm_channel.cpp): the wire format (a header, then a ring of slot headers, then the
// slots), the POSIX calls that create and open it, and its doorbell.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace fsdp::comm::detail {

struct alignas(64) SegHeader {
  uint64_t magic;
  uint64_t nonce;
  int64_t slot_bytes;
  int32_t nslots;
  int32_t pid;
  alignas(64) std::atomic<uint32_t> doorbell;  // bumped when something for this rank moved
  std::atomic<uint32_t> sleepers;              // threads of this rank in futex_wait
  alignas(64) std::atomic<uint32_t> failed;    // this rank gave up on the group...
  char reason[512];                            // ...for this reason (set before `failed`)
};

struct alignas(64) SlotHeader {
  std::atomic<uint64_t> seq;           // fragment number held, 0 = none yet
  std::atomic<uint32_t> readers_left;  // readers that have not released it
  // -1: the fragment's bytes are in the slot. Else they are at this offset of the writer's
  // exchange arena (written before seq is published, read after it is seen).
  int64_t src_off = -1;
  // Which operation of the writer's the fragment belongs to ([Note: checked slots] in
  // shm_op.h); written before seq is published, checked by every reader after it is seen.
  uint64_t op_number = 0;
  int64_t op_bytes = 0;
  uint32_t op_kind = 0;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free (address-free)");

/// One mapped segment: ours (created) or a peer's (opened).
struct ShmSegment {
  void* base;
  int64_t bytes;
  int nslots;
  int64_t slot_bytes;

  /// Bytes of the mapping of a segment of `nslots` slots of `slot_bytes`.
  static int64_t mapping_bytes(int nslots, int64_t slot_bytes);

  // Takes over a mapping of mapping_bytes(nslots, slot_bytes) at `base`.
  ShmSegment(void* base, int nslots, int64_t slot_bytes);
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  SegHeader* hdr() const { return static_cast<SegHeader*>(base); }
  SlotHeader* slot(int i) const {
    return reinterpret_cast<SlotHeader*>(static_cast<char*>(base) + sizeof(SegHeader)) + i;
  }
  char* data(int i) const;
};

/// Creates, sizes (reserving the pages: a full /dev/shm fails here, not with SIGBUS on
/// first touch) and maps our segment under a fresh name (`name`). On failure returns
/// nullptr and says why.
std::unique_ptr<ShmSegment> create_segment(int nslots, int64_t slot_bytes, uint64_t nonce, std::string* name,
                                           std::string* why);
/// Maps a peer's segment `name` and checks that it is the one the peer published (`nonce`,
/// its ring's shape). On failure returns nullptr and says why.
std::unique_ptr<ShmSegment> open_segment(const std::string& name, uint64_t nonce, int nslots, int64_t slot_bytes,
                                         std::string* why);

/// Tells the segment's owner that something for it moved, waking it if it sleeps.
void ring_doorbell(SegHeader* h);
/// Sleeps until `h`'s doorbell differs from `bell` (a peer rang it) or `timeout` passes.
void sleep_on_doorbell(SegHeader* h, uint32_t bell, std::chrono::microseconds timeout);

/// One spin-wait pause.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace fsdp::comm::detail
