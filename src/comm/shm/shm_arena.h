#pragma once
// Internal to src/comm: the exchange arena of one process, which the shared-memory
// channels' peers read in place. See [Note: exchange arena] in shm_arena.cpp.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <c10/core/Allocator.h>

namespace fsdp::comm::detail {

/// Blocks are carved in pages of this size, which mappings of an arena need too.
constexpr int64_t kArenaPage = 4096;

class ShmArena : public std::enable_shared_from_this<ShmArena> {
 public:
  /// This process's arena: an unlinked shared-memory file of kArenaBytes with no pages
  /// reserved, kept open so that peers can open it through /proc. nullptr (and `why`)
  /// when /dev/shm cannot hold even the header.
  static std::shared_ptr<ShmArena> create(std::string* why);
  /// A peer's arena, opened through /proc/<pid>/fd/<fd> and checked against `nonce`
  /// (a namesake in another PID namespace or a recycled pid fails the check).
  static std::shared_ptr<ShmArena> open(int pid, int fd, uint64_t nonce, std::string* why);
  ~ShmArena();
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  int fd() const { return fd_; }
  uint64_t nonce() const { return nonce_; }
  const char* base() const { return base_; }
  int64_t bytes() const { return bytes_; }
  /// Offset of [p, p + len) in this arena, or -1 when it is not entirely inside.
  int64_t offset_of(const void* p, int64_t len) const;

  /// `nbytes` of this process's arena with their pages reserved (a full /dev/shm fails
  /// here, not with SIGBUS on first touch); freeing the DataPtr hands the pages back.
  /// An empty DataPtr when the arena or /dev/shm is full: the caller falls back to
  /// ordinary memory, whose collectives take the copying path.
  /// `phase` < one page: the block starts `phase` bytes into its first page (a mapped
  /// flat buffer needs a chunk at the page offset its place in the flat buffer has;
  /// [Note: mapped flat buffer] in include/fsdp/comm/mapped_flat.h).
  at::DataPtr allocate(size_t nbytes, int64_t phase = 0);

 private:
  // A mapping of kArenaBytes at `base` of the file `fd`, which this object then owns.
  ShmArena(int fd, bool owner, uint64_t nonce, char* base);
  void release(int64_t off, int64_t len);

  int fd_ = -1;
  bool owner_ = false;
  uint64_t nonce_ = 0;
  char* base_ = nullptr;
  int64_t bytes_ = 0;
  std::mutex mu_;
  std::map<int64_t, int64_t> free_;  // offset -> length, coalesced; owner only
};

}  // namespace fsdp::comm::detail
