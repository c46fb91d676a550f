#pragma once
// Internal to src/state: a file written at given offsets, whole aligned blocks straight from
// the caller's memory (O_DIRECT), the rest through the page cache.
//
// [Note: direct writes]
// A buffered write() copies every byte into the page cache before the disk sees it: for a
// checkpoint that copy is most of the writer's CPU (the CRC is the rest). With O_DIRECT the
// disk reads the caller's memory, so the only pass over the bytes is the checksum. O_DIRECT
// needs the file offset, the length and the memory address aligned (statx's
// STATX_DIOALIGN says to what; 512 bytes on a common disk), which a record written from a
// tensor's memory meets only in part: [Note: aligned records] in checkpoint_format.h lays
// records out so that their whole pages do. So each write_at() splits its bytes: the whole
// 4096-byte blocks whose memory is aligned go to a second descriptor opened with O_DIRECT,
// the partial blocks at either end (and bytes whose memory is not aligned) through the page
// cache. The two never write the same block, which is what keeps them coherent: a direct
// write invalidates only the page-cache range it writes, and no buffered write touches it.
// Where the file system refuses O_DIRECT (at open, or on a first write: tmpfs, some network
// file systems) everything goes through the page cache; the file's bytes are the same
// either way. sync() makes both durable (fsync flushes the disk's cache for direct writes
// too).
#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdp::state::format {

class DirectFile {
 public:
  /// The unit of direct writes: blocks of this many bytes at offsets that are multiples of it.
  static constexpr size_t kBlock = 4096;

  /// Creates (or truncates) `path` for writing; throws naming the path and the error.
  explicit DirectFile(std::string path);
  ~DirectFile();
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;

  /// Writes `n` bytes from `p` at `offset` (any offsets, in any order, each byte once).
  void write_at(int64_t offset, const char* p, size_t n);
  /// Starts writing back what [offset, offset + n) left in the page cache (asynchronous).
  void start_writeback(int64_t offset, size_t n);
  /// fsync; throws naming the path and the error.
  void sync();
  /// Closes both descriptors (idempotent).
  void close();

  /// Whether direct writes are in use (false: refused by the file system, or turned off by
  /// set_checkpoint_direct_io(false)).
  bool direct() const { return direct_fd_ >= 0; }
  /// Bytes written with O_DIRECT so far.
  int64_t direct_bytes() const { return direct_bytes_; }
  const std::string& path() const { return path_; }

 private:
  void open_direct();
  void write_buffered(int64_t offset, const char* p, size_t n);
  // Whole aligned blocks of [p, p + n) at `offset` (aligned): false when the kernel refused
  // them (direct writes are then off for this file).
  bool write_direct(int64_t offset, const char* p, size_t n);

  std::string path_;
  int fd_ = -1;         // buffered
  int direct_fd_ = -1;  // O_DIRECT, or -1
  size_t mem_align_ = kBlock;
  int64_t direct_bytes_ = 0;
};

}  // namespace fsdp::state::format
