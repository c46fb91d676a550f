#include "orphan_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace fsdp::launcher {

namespace {

/// Message meaning "the job ended normally"; every other message is a process-group id (> 0).
constexpr pid_t kReleased = 0;

[[noreturn]] void guard_main(int from_launcher) {
  // The guard shares fsdp-run's process group, so Ctrl-C in a terminal reaches it too; only
  // fsdp-run decides when the job stops.
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_IGN);
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  // Hold no terminal or pipe of fsdp-run's open: a reader of fsdp-run's output must see EOF
  // when fsdp-run exits, not when the guard does.
  int devnull = ::open("/dev/null", O_RDWR);
  if (devnull >= 0) {
    for (int fd : {0, 1, 2}) ::dup2(devnull, fd);
    if (devnull > 2) ::close(devnull);
  }
  std::vector<pid_t> groups;
  for (;;) {
    pid_t message;
    ssize_t n = ::read(from_launcher, &message, sizeof(message));
    if (n < 0 && errno == EINTR) continue;
    if (n == static_cast<ssize_t>(sizeof(message))) {
      if (message == kReleased) ::_exit(0);
      groups.push_back(message);
      continue;
    }
    break;  // EOF: fsdp-run died without releasing us.
  }
  for (pid_t pgid : groups) ::kill(-pgid, SIGKILL);
  ::_exit(0);
}

}  // namespace

OrphanGuard::OrphanGuard() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    std::fprintf(stderr, "fsdp-run: warning: no orphan guard (pipe: %s); if fsdp-run is killed, "
                 "subprocesses of ranks may keep running\n", std::strerror(errno));
    return;
  }
  pid_t pid = ::fork();
  if (pid < 0) {
    std::fprintf(stderr, "fsdp-run: warning: no orphan guard (fork: %s); if fsdp-run is "
                 "killed, subprocesses of ranks may keep running\n", std::strerror(errno));
    ::close(fds[0]);
    ::close(fds[1]);
    return;
  }
  if (pid == 0) {
    ::close(fds[1]);
    // Close everything else inherited (e.g. the signalfd) except the read end.
    for (int fd = 3; fd < 1024; ++fd) {
      if (fd != fds[0]) ::close(fd);
    }
    guard_main(fds[0]);
  }
  ::close(fds[0]);
  guard_pid_ = pid;
  to_guard_ = fds[1];
}

OrphanGuard::~OrphanGuard() { release(); }

void OrphanGuard::watch(pid_t pgid) {
  if (to_guard_ < 0 || pgid <= 0) return;
  // A pipe write of a few bytes is atomic; the guard reads as fast as ranks are started.
  ssize_t ignored = ::write(to_guard_, &pgid, sizeof(pgid));
  (void)ignored;
}

void OrphanGuard::release() {
  if (to_guard_ < 0) return;
  pid_t message = kReleased;
  ssize_t ignored = ::write(to_guard_, &message, sizeof(message));
  (void)ignored;
  ::close(to_guard_);
  to_guard_ = -1;
  while (::waitpid(guard_pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
  guard_pid_ = -1;
}

}  // namespace fsdp::launcher
