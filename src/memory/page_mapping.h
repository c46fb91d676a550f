#pragma once
// Page-aligned memory the library maps and owns: an anonymous private mapping.
//
// [Note: page mappings]
// Memory that a copy-on-write snapshot protects ([Note: copy-on-write snapshots] in
// cow_snapshot.h) must be the library's own pages: page-aligned, so that protecting it
// touches nothing else, and private, so that no other process writes it behind the
// protection. A PageMapping is exactly that: mmap(MAP_PRIVATE | MAP_ANONYMOUS), its length
// rounded up to whole pages, unmapped when it dies. Its pages are zero until written and
// cost nothing until first touched.
// Only state that this process's user-space code writes may live here if it is ever
// snapshotted: the kernel (read(), recv(), io_uring) gets EFAULT writing a protected page,
// and a device (a GPU copying to host memory, RDMA) writes straight past the protection. A
// receive buffer or a device's staging buffer belongs elsewhere.
#include <cstddef>

namespace fsdp::memory {

class PageMapping {
 public:
  /// An empty mapping (no pages).
  PageMapping() = default;
  /// Maps `bytes` rounded up to whole pages (none for 0); throws std::runtime_error naming
  /// the size and the reason when the kernel refuses.
  explicit PageMapping(size_t bytes);
  ~PageMapping();
  PageMapping(PageMapping&& other) noexcept;
  PageMapping& operator=(PageMapping&& other) noexcept;
  PageMapping(const PageMapping&) = delete;
  PageMapping& operator=(const PageMapping&) = delete;

  void* data() const { return data_; }
  /// The mapped length: the requested bytes rounded up to the page size.
  size_t bytes() const { return bytes_; }

  /// The system's page size (sysconf(_SC_PAGESIZE)).
  static size_t page_size();

 private:
  void unmap() noexcept;

  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace fsdp::memory
