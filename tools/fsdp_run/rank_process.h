#pragma once
/// One rank: a child process in its own process group, with stdout and stderr on pipes.
///
/// [Note: rank states] Each rank moves only along these arrows (checked by transition()):
///
///   Starting --exec ok--------> Running --stop(sig)--> Terminating --kill()--> Killing
///       |                          |                        |                     |
///       +--exec failed--> FailedToStart                     +---- exit seen ------+--> Exited
///                                  +------------------ exit seen ---------------------> Signaled
///
///   Starting       forked; we do not yet know whether exec worked.
///   Running        exec worked; the program runs.
///   Terminating    we sent the stop signal (SIGTERM, or the signal fsdp-run received) to the
///                  rank's process group and are inside the grace period.
///   Killing        we sent SIGKILL to the group (grace over, or a second signal).
///   Exited         exited by itself with a code (after a stop signal too, if it handled it).
///   Signaled       died by a signal (ours or anyone's).
///   FailedToStart  exec failed; exec_errno() says why. Already reaped.
///
/// [Note: zombie keeps the group] An exit is noticed with waitid(WNOWAIT), which leaves the
/// rank a zombie. While the zombie exists its pid cannot be reused, so its process-group id
/// still names only this job's processes and kill(-pgid) is safe: the supervisor relies on
/// this to kill leftovers of an exited rank (e.g. a background child) before reap().

#include <sys/types.h>

#include <string>
#include <vector>

#include "signals.h"

namespace fsdp::launcher {

enum class RankState { Starting, Running, Terminating, Killing, Exited, Signaled, FailedToStart };
const char* to_string(RankState state);

class RankProcess {
 public:
  explicit RankProcess(int rank) : rank_(rank) {}
  ~RankProcess();
  RankProcess(RankProcess&& other) noexcept;
  RankProcess(const RankProcess&) = delete;
  RankProcess& operator=(const RankProcess&) = delete;
  RankProcess& operator=(RankProcess&&) = delete;

  /// Forks and execs `argv` with `env`; returns once exec has worked (Running) or failed
  /// (FailedToStart). The child gets its own process group, PR_SET_PDEATHSIG(SIGKILL) so it
  /// never outlives fsdp-run, and the signal state fsdp-run started with.
  /// Throws LauncherError if pipes or fork fail.
  void start(const std::vector<std::string>& argv, const std::vector<std::string>& env,
             const SignalInbox& signals);

  int rank() const { return rank_; }
  pid_t pid() const { return pid_; }
  RankState state() const { return state_; }
  /// The program is (or may still be) running: Running, Terminating or Killing.
  bool alive() const;
  /// A rank that ended with exit code 0 or was never started is not a failure.
  bool failed() const;
  int exec_errno() const { return exec_errno_; }
  /// For Exited: the exit code. For Signaled: the signal number.
  int exit_code() const { return exit_code_; }
  int term_signal() const { return term_signal_; }
  bool core_dumped() const { return core_dumped_; }
  /// What fsdp-run exits with when this rank is the first failure: code, or 128+signal.
  int launcher_exit_code() const;
  /// "exited with code 3", "was killed by signal 9 (SIGKILL)", ...
  std::string describe_end() const;

  /// Read ends of the rank's stdout/stderr pipes (non-blocking), -1 once closed.
  int stdout_fd() const { return stdout_fd_; }
  int stderr_fd() const { return stderr_fd_; }
  void close_stdout();
  void close_stderr();

  /// Non-blocking check for the rank's exit (see [Note: zombie keeps the group]).
  /// Returns true exactly once, when the rank moves to Exited or Signaled.
  bool poll_exit();
  /// Sends `sig` to the rank's process group: Running -> Terminating.
  void stop(int sig);
  /// Sends SIGKILL to the rank's process group: Running/Terminating -> Killing.
  void kill();
  /// For an exited rank not yet reaped: SIGKILL whatever is left in its process group.
  void kill_leftovers();
  /// Collects the zombie; after this the pid may be reused, so no more group signals.
  void reap();

 private:
  void transition(RankState to);
  void signal_group(int sig);

  int rank_;
  RankState state_ = RankState::Starting;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
  int exec_errno_ = 0;
  int exit_code_ = 0;
  int term_signal_ = 0;
  bool core_dumped_ = false;
};

}  // namespace fsdp::launcher
