#include "signals.h"

#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "rank_env.h"  // LauncherError

namespace fsdp::launcher {

bool is_stop_signal(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP; }

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);  // glibc >= 2.32
  if (abbrev == nullptr) return "signal " + std::to_string(sig);
  return std::string("SIG") + abbrev;
}

SignalInbox::SignalInbox() {
  // A SIGCHLD inherited as ignored would make the kernel reap ranks behind our back, and we
  // would never learn their exit codes.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGCHLD, &dfl, nullptr);

  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  ::sigemptyset(&ign.sa_mask);
  ::sigaction(SIGPIPE, &ign, &original_sigpipe_);

  sigset_t wanted;
  ::sigemptyset(&wanted);
  ::sigaddset(&wanted, SIGCHLD);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction current {};
    ::sigaction(sig, nullptr, &current);
    if (current.sa_handler != SIG_IGN) ::sigaddset(&wanted, sig);
  }
  if (::sigprocmask(SIG_BLOCK, &wanted, &original_mask_) != 0) {
    throw LauncherError(std::string("sigprocmask failed: ") + std::strerror(errno));
  }
  fd_ = ::signalfd(-1, &wanted, SFD_NONBLOCK | SFD_CLOEXEC);
  if (fd_ < 0) {
    throw LauncherError(std::string("signalfd failed: ") + std::strerror(errno));
  }
}

SignalInbox::~SignalInbox() {
  if (fd_ >= 0) ::close(fd_);
  ::sigprocmask(SIG_SETMASK, &original_mask_, nullptr);
  ::sigaction(SIGPIPE, &original_sigpipe_, nullptr);
}

std::vector<int> SignalInbox::take_pending() {
  std::vector<int> signals;
  signalfd_siginfo info;
  for (;;) {
    ssize_t n = ::read(fd_, &info, sizeof(info));
    if (n == static_cast<ssize_t>(sizeof(info))) {
      signals.push_back(static_cast<int>(info.ssi_signo));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;  // EAGAIN: nothing more pending.
    }
  }
  return signals;
}

void SignalInbox::restore_for_exec() const {
  ::sigaction(SIGPIPE, &original_sigpipe_, nullptr);
  ::sigprocmask(SIG_SETMASK, &original_mask_, nullptr);
}

}  // namespace fsdp::launcher
