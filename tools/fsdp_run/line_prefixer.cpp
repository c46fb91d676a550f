#include "line_prefixer.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>

namespace fsdp::launcher {

void OutputStream::write_all(std::string_view bytes) {
  while (!broken_ && !bytes.empty()) {
    ssize_t n = ::write(fd_, bytes.data(), bytes.size());
    if (n > 0) {
      bytes.remove_prefix(static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // We may have inherited a non-blocking stdout; wait until it drains.
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, -1);
    } else {
      broken_ = true;  // EPIPE, EBADF, ENOSPC...: nowhere left to write this stream.
    }
  }
}

bool RepeatedRecordFilter::drop(std::string_view line) {
  constexpr std::string_view kHead = "collective record (rank ";
  const std::size_t head = line.find(kHead);
  if (head == std::string_view::npos) return false;
  const std::size_t text = line.find("): ", head + kHead.size());
  if (text == std::string_view::npos) return false;
  return !shown_.emplace(line.substr(text + 3)).second;
}

void LinePrefixer::add_line(std::string& out, std::string_view line) const {
  if (filter_ != nullptr && filter_->drop(line)) return;
  out += prefix_;
  out.append(line);
}

void LinePrefixer::feed(std::string_view bytes) {
  // All lines completed by this chunk go out in one write.
  std::string out;
  while (!bytes.empty()) {
    std::size_t nl = bytes.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(bytes);
      if (partial_.size() >= kMaxPartialBytes) {
        out += prefix_;
        out += partial_;
        out += '\n';
        partial_.clear();
      }
      break;
    }
    partial_.append(bytes.substr(0, nl + 1));
    add_line(out, partial_);
    partial_.clear();
    bytes.remove_prefix(nl + 1);
  }
  if (!out.empty()) out_->write_all(out);
}

void LinePrefixer::finish() {
  if (partial_.empty()) return;
  out_->write_all(prefix_ + partial_ + "\n");
  partial_.clear();
}

}  // namespace fsdp::launcher
