// See [Note: direct writes] in direct_file.h.
#include "direct_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "checkpoint_testing.h"

namespace fsdp::state::format {

namespace direct_file_detail {

std::atomic<bool> direct_io_on{true};  // set_checkpoint_direct_io (checkpoint_testing.h)

std::string failure(const char* what, const std::string& path, int err) {
  return std::string("fsdp checkpoint: ") + what + " '" + path + "' failed: " + std::strerror(err);
}

// The memory alignment O_DIRECT needs for `fd`'s file, or 0 when the kernel cannot say or
// the file system's offset alignment is coarser than a block (then no direct writes).
size_t direct_memory_alignment(int fd) {
#if defined(STATX_DIOALIGN)
  struct statx st;
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) != 0) return 0;
  if (!(st.stx_mask & STATX_DIOALIGN) || st.stx_dio_offset_align == 0) return 0;
  if (st.stx_dio_offset_align > DirectFile::kBlock || DirectFile::kBlock % st.stx_dio_offset_align != 0) return 0;
  return std::max<size_t>(st.stx_dio_mem_align, 1);
#else
  (void)fd;
  return 0;
#endif
}

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

}  // namespace direct_file_detail

DirectFile::DirectFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error(direct_file_detail::failure("creating", path_, errno));
  if (direct_file_detail::direct_io_on.load(std::memory_order_relaxed)) open_direct();
}

DirectFile::~DirectFile() { close(); }

void DirectFile::open_direct() {
  mem_align_ = direct_file_detail::direct_memory_alignment(fd_);
  if (mem_align_ == 0) return;
  direct_fd_ = ::open(path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);  // refused: EINVAL
}

void DirectFile::write_at(int64_t offset, const char* p, size_t n) {
  const auto block = static_cast<int64_t>(kBlock);
  // Phases: the partial block before the first boundary, whole blocks, the partial block after.
  const int64_t body_begin = std::min(direct_file_detail::round_up(offset, block), offset + int64_t(n));
  const int64_t body_end = std::max(body_begin, (offset + int64_t(n)) / block * block);
  const char* body = p + (body_begin - offset);
  const bool aligned = reinterpret_cast<uintptr_t>(body) % mem_align_ == 0;
  if (direct() && aligned && body_end > body_begin &&
      write_direct(body_begin, body, size_t(body_end - body_begin))) {
    write_buffered(offset, p, size_t(body_begin - offset));
    write_buffered(body_end, p + (body_end - offset), size_t(offset + int64_t(n) - body_end));
    return;
  }
  write_buffered(offset, p, n);
}

void DirectFile::write_buffered(int64_t offset, const char* p, size_t n) {
  for (size_t done = 0; done < n;) {
    const ssize_t w = ::pwrite(fd_, p + done, n - done, static_cast<off_t>(offset + int64_t(done)));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw std::runtime_error(direct_file_detail::failure("writing", path_, w < 0 ? errno : EIO));
    done += size_t(w);
  }
}

bool DirectFile::write_direct(int64_t offset, const char* p, size_t n) {
  for (size_t done = 0; done < n;) {
    const ssize_t w = ::pwrite(direct_fd_, p + done, n - done, static_cast<off_t>(offset + int64_t(done)));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL && done == 0) {  // the file system takes no direct writes after all
      ::close(direct_fd_);
      direct_fd_ = -1;
      return false;
    }
    if (w <= 0) throw std::runtime_error(direct_file_detail::failure("writing (O_DIRECT)", path_, w < 0 ? errno : EIO));
    if (size_t(w) % kBlock != 0) {  // a short write mid-block: the rest goes through the page cache
      direct_bytes_ += w;
      write_buffered(offset + int64_t(done) + w, p + done + size_t(w), n - done - size_t(w));
      return true;
    }
    done += size_t(w);
    direct_bytes_ += w;
  }
  return true;
}

void DirectFile::start_writeback(int64_t offset, size_t n) {
  ::sync_file_range(fd_, static_cast<off_t>(offset), static_cast<off_t>(n), SYNC_FILE_RANGE_WRITE);
}

void DirectFile::sync() {
  if (::fsync(fd_) != 0) throw std::runtime_error(direct_file_detail::failure("fsync of", path_, errno));
}

void DirectFile::close() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (fd_ >= 0) ::close(fd_);
  direct_fd_ = fd_ = -1;
}

}  // namespace fsdp::state::format

namespace fsdp::state::detail {

void set_checkpoint_direct_io(bool on) {
  state::format::direct_file_detail::direct_io_on.store(on, std::memory_order_relaxed);
}

}  // namespace fsdp::state::detail
