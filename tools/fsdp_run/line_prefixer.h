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
#include <functional>
#include <set>
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

/// The flight recorder's line ("collective record (rank N): <text>", src/comm/flight_exchange.h),
/// which every rank of a failed job prints with the same text: shown for the first rank that
/// prints a text, dropped for the others, so the job says it once.
class RepeatedRecordFilter {
 public:
  /// True when `line` is a record line whose text was shown already.
  bool drop(std::string_view line);

 private:
  std::set<std::string, std::less<>> shown_;
};

class LinePrefixer {
 public:
  /// A partial longer than this is written as a line of its own (with a '\n' added), so a
  /// rank that never writes '\n' cannot make fsdp-run buffer without bound.
  static constexpr std::size_t kMaxPartialBytes = 64 * 1024;

  LinePrefixer(std::string prefix, OutputStream& out, RepeatedRecordFilter* filter = nullptr)
      : prefix_(std::move(prefix)), out_(&out), filter_(filter) {}

  /// Takes the next bytes read from the rank; writes every line they complete.
  void feed(std::string_view bytes);
  /// The rank's stream ended: writes a pending partial as a last line, with a '\n' added.
  void finish();

 private:
  void add_line(std::string& out, std::string_view line) const;

  std::string prefix_;
  OutputStream* out_;
  RepeatedRecordFilter* filter_;  // null: every line is shown
  std::string partial_;
};

}  // namespace fsdp::launcher
