#include "page_mapping.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace fsdp::memory {

size_t PageMapping::page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

PageMapping::PageMapping(size_t bytes) {
  if (bytes == 0) return;
  const size_t page = page_size();
  if (bytes > SIZE_MAX - (page - 1)) {
    throw std::runtime_error("fsdp::memory::PageMapping: cannot map " + std::to_string(bytes) +
                             " bytes: the size does not fit the address space");
  }
  const size_t rounded = (bytes + page - 1) / page * page;
  void* p = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw std::runtime_error("fsdp::memory::PageMapping: mmap of " + std::to_string(rounded) +
                             " bytes (anonymous, private) failed: " + std::strerror(err));
  }
  data_ = p;
  bytes_ = rounded;
}

PageMapping::~PageMapping() { unmap(); }

PageMapping::PageMapping(PageMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

PageMapping& PageMapping::operator=(PageMapping&& other) noexcept {
  if (this != &other) {
    unmap();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void PageMapping::unmap() noexcept {
  // munmap of a mapping we made fails only for bad arguments; nothing to report in a destructor.
  if (data_ != nullptr) ::munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace fsdp::memory
