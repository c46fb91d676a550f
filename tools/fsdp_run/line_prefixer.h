#pragma once
/// Rank output as torchrun's --tee shows it: every line of rank N, on the stream it was
/// written to, as "[rankN]: line".
///
/// Words used here:
///   line     bytes up to and including '\n'.
///   partial  bytes after the last '\n' seen so far; they wait for the rest of their line.
/// Lines are written to fsdp-run's stream whole, in one write, and only by the supervisor's
/// single thread, so lines of different ranks never mix mid-line.

#include <cstddef>
#include <string>
#include <string_view>

namespace fsdp::launcher {

/// One of fsdp-run's own output streams (its stdout or stderr).
class OutputStream {
 public:
  explicit OutputStream(int fd) : fd_(fd) {}
  /// Writes all of `bytes`, retrying short writes. If the reader is gone (EPIPE, e.g.
  /// `fsdp-run ... | head`), later output is dropped: losing the log must not kill the job.
  void write_all(std::string_view bytes);

 private:
  int fd_;
  bool broken_ = false;
};

class LinePrefixer {
 public:
  /// A partial longer than this is written as a line of its own (with a '\n' added), so a
  /// rank that never writes '\n' cannot make fsdp-run buffer without bound.
  static constexpr std::size_t kMaxPartialBytes = 64 * 1024;

  LinePrefixer(std::string prefix, OutputStream& out) : prefix_(std::move(prefix)), out_(&out) {}

  /// Takes the next bytes read from the rank; writes every line they complete.
  void feed(std::string_view bytes);
  /// The rank's stream ended: writes a pending partial as a last line, with a '\n' added.
  void finish();

 private:
  std::string prefix_;
  OutputStream* out_;
  std::string partial_;
};

}  // namespace fsdp::launcher
