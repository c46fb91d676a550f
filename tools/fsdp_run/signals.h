#pragma once
/// The signals fsdp-run reacts to, delivered as a file descriptor (signalfd) rather than to
/// handlers, so the supervisor's one poll() loop sees signals, rank exits (SIGCHLD) and rank
/// output in order, and no work ever runs in signal-handler context.

#include <signal.h>

#include <string>
#include <vector>

namespace fsdp::launcher {

/// Signals that ask fsdp-run to stop the job; they are forwarded to the ranks.
bool is_stop_signal(int sig);

/// "SIGKILL", or "signal 42" for a signal without a name.
std::string signal_name(int sig);

class SignalInbox {
 public:
  /// Blocks SIGCHLD and the stop signals and opens a signalfd for them. A stop signal that
  /// fsdp-run inherited as ignored (e.g. SIGHUP under nohup, SIGINT for a background job of
  /// a script) stays ignored: whoever started us asked for that. Also ignores SIGPIPE, so a
  /// closed stdout reader cannot kill the launcher (and, through PDEATHSIG, the whole job).
  SignalInbox();
  ~SignalInbox();
  SignalInbox(const SignalInbox&) = delete;
  SignalInbox& operator=(const SignalInbox&) = delete;

  int fd() const { return fd_; }
  /// Signals received since the last call, in arrival order (never blocks).
  std::vector<int> take_pending();

  /// Called in a forked child before exec: puts back the signal mask and SIGPIPE disposition
  /// fsdp-run started with (both survive exec). Async-signal-safe.
  void restore_for_exec() const;

 private:
  int fd_ = -1;
  sigset_t original_mask_;
  struct sigaction original_sigpipe_;
};

}  // namespace fsdp::launcher
