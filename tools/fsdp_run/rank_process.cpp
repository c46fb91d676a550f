#include "rank_process.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "rank_env.h"  // LauncherError

namespace fsdp::launcher {

const char* to_string(RankState state) {
  switch (state) {
    case RankState::Starting: return "Starting";
    case RankState::Running: return "Running";
    case RankState::Terminating: return "Terminating";
    case RankState::Killing: return "Killing";
    case RankState::Exited: return "Exited";
    case RankState::Signaled: return "Signaled";
    case RankState::FailedToStart: return "FailedToStart";
  }
  return "?";
}

namespace {

bool transition_allowed(RankState from, RankState to) {
  using S = RankState;
  switch (to) {
    case S::Running:
    case S::FailedToStart: return from == S::Starting;
    case S::Terminating: return from == S::Running;
    case S::Killing: return from == S::Running || from == S::Terminating;
    case S::Exited:
    case S::Signaled: return from == S::Running || from == S::Terminating || from == S::Killing;
    case S::Starting: return false;
  }
  return false;
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

/// Pipe with both ends close-on-exec: no rank inherits another rank's pipes (which would keep
/// them open past that rank's exit). dup2 onto 1/2 in the child clears the flag there.
void make_pipe(int fds[2], int rank, const char* what) {
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    throw LauncherError("cannot create the " + std::string(what) + " pipe for rank " +
                        std::to_string(rank) + ": " + std::strerror(errno) +
                        (errno == EMFILE ? " (raise `ulimit -n` or lower --nproc)" : ""));
  }
}

/// Only async-signal-safe calls after fork(); on any failure, tell the parent through
/// `status_fd` and exit 127 like a shell.
[[noreturn]] void exec_child(char* const* argv, char* const* envp, int out_fd, int err_fd,
                             int status_fd, pid_t parent, const SignalInbox& signals) {
  int err = 0;
  ::setpgid(0, 0);  // own process group: stopping the rank stops its subprocesses too
  // Die with fsdp-run, even if it is SIGKILLed and cannot clean up.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) err = errno;
  // fsdp-run may have died before prctl took effect; then we were re-parented already.
  if (err == 0 && ::getppid() != parent) ::_exit(127);
  if (err == 0 && (::dup2(out_fd, STDOUT_FILENO) < 0 || ::dup2(err_fd, STDERR_FILENO) < 0)) {
    err = errno;
  }
  if (err == 0) {
    signals.restore_for_exec();
    ::execvpe(argv[0], argv, envp);
    err = errno;
  }
  ssize_t ignored = ::write(status_fd, &err, sizeof(err));
  (void)ignored;
  ::_exit(127);
}

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

}  // namespace

RankProcess::RankProcess(RankProcess&& other) noexcept
    : rank_(other.rank_),
      state_(other.state_),
      pid_(other.pid_),
      reaped_(other.reaped_),
      stdout_fd_(other.stdout_fd_),
      stderr_fd_(other.stderr_fd_),
      exec_errno_(other.exec_errno_),
      exit_code_(other.exit_code_),
      term_signal_(other.term_signal_),
      core_dumped_(other.core_dumped_) {
  other.stdout_fd_ = -1;
  other.stderr_fd_ = -1;
  other.pid_ = -1;
  other.reaped_ = true;
}

RankProcess::~RankProcess() {
  close_fd(stdout_fd_);
  close_fd(stderr_fd_);
}

void RankProcess::transition(RankState to) {
  if (!transition_allowed(state_, to)) {
    // A bug in fsdp-run, not a user error: say exactly what happened and stop.
    std::fprintf(stderr, "fsdp-run: internal error: rank %d (pid %d) cannot go from %s to %s\n",
                 rank_, static_cast<int>(pid_), to_string(state_), to_string(to));
    std::abort();
  }
  state_ = to;
}

void RankProcess::start(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                        const SignalInbox& signals) {
  int out[2], err[2], status[2];
  make_pipe(out, rank_, "stdout");
  make_pipe(err, rank_, "stderr");
  make_pipe(status, rank_, "exec-status");
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::vector<char*> c_argv = c_strings(argv);
  std::vector<char*> c_env = c_strings(env);
  const pid_t parent = ::getpid();

  pid_t pid = ::fork();
  if (pid < 0) {
    int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1], status[0], status[1]}) ::close(fd);
    throw LauncherError("cannot fork rank " + std::to_string(rank_) + ": " + std::strerror(e));
  }
  if (pid == 0) {
    ::close(out[0]);
    ::close(err[0]);
    ::close(status[0]);
    exec_child(c_argv.data(), c_env.data(), out[1], err[1], status[1], parent, signals);
  }
  pid_ = pid;
  // Also set the group from this side, so it exists before we might signal it (classic race).
  ::setpgid(pid, pid);
  ::close(out[1]);
  ::close(err[1]);
  ::close(status[1]);
  stdout_fd_ = out[0];
  stderr_fd_ = err[0];
  ::fcntl(stdout_fd_, F_SETFL, O_NONBLOCK);
  ::fcntl(stderr_fd_, F_SETFL, O_NONBLOCK);

  // The status pipe closes on a successful exec (CLOEXEC) and carries errno otherwise.
  int child_errno = 0;
  ssize_t n;
  do {
    n = ::read(status[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  ::close(status[0]);
  if (n == 0) {
    transition(RankState::Running);
    return;
  }
  exec_errno_ = n == static_cast<ssize_t>(sizeof(child_errno)) ? child_errno : EIO;
  ::waitpid(pid_, nullptr, 0);  // it is exiting right now
  reaped_ = true;
  close_fd(stdout_fd_);
  close_fd(stderr_fd_);
  transition(RankState::FailedToStart);
}

bool RankProcess::alive() const {
  return state_ == RankState::Running || state_ == RankState::Terminating ||
         state_ == RankState::Killing;
}

bool RankProcess::failed() const {
  return state_ == RankState::Signaled || (state_ == RankState::Exited && exit_code_ != 0);
}

int RankProcess::launcher_exit_code() const {
  if (state_ == RankState::Signaled) return 128 + term_signal_;
  if (state_ == RankState::FailedToStart) return exec_errno_ == ENOENT ? 127 : 126;
  return exit_code_;
}

std::string RankProcess::describe_end() const {
  switch (state_) {
    case RankState::Exited: return "exited with code " + std::to_string(exit_code_);
    case RankState::Signaled:
      return "was killed by signal " + std::to_string(term_signal_) + " (" +
             signal_name(term_signal_) + ")" + (core_dumped_ ? " (core dumped)" : "");
    case RankState::FailedToStart:
      return std::string("could not be started: ") + std::strerror(exec_errno_);
    default: return std::string("is ") + to_string(state_);
  }
}

void RankProcess::close_stdout() { close_fd(stdout_fd_); }
void RankProcess::close_stderr() { close_fd(stderr_fd_); }

bool RankProcess::poll_exit() {
  if (!alive()) return false;
  siginfo_t info;
  std::memset(&info, 0, sizeof(info));
  if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
      info.si_pid == 0) {
    return false;
  }
  if (info.si_code == CLD_EXITED) {
    exit_code_ = info.si_status;
    transition(RankState::Exited);
  } else {  // CLD_KILLED or CLD_DUMPED
    term_signal_ = info.si_status;
    core_dumped_ = info.si_code == CLD_DUMPED;
    transition(RankState::Signaled);
  }
  return true;
}

void RankProcess::signal_group(int sig) {
  // Never signal a reaped pid's group: the id may belong to someone else by now.
  if (pid_ > 0 && !reaped_) ::kill(-pid_, sig);
}

void RankProcess::stop(int sig) {
  transition(RankState::Terminating);
  signal_group(sig);
}

void RankProcess::kill() {
  transition(RankState::Killing);
  signal_group(SIGKILL);
}

void RankProcess::kill_leftovers() {
  if (state_ == RankState::Exited || state_ == RankState::Signaled) signal_group(SIGKILL);
}

void RankProcess::reap() {
  if (reaped_ || pid_ <= 0) return;
  if (alive()) {
    // Only reached on the way out after a launcher error; never leave a rank behind.
    signal_group(SIGKILL);
  }
  while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
  reaped_ = true;
}

}  // namespace fsdp::launcher
