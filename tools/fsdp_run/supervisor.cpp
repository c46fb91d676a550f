#include "supervisor.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

extern char** environ;

namespace fsdp::launcher {

const char* to_string(LauncherState state) {
  switch (state) {
    case LauncherState::Running: return "Running";
    case LauncherState::Stopping: return "Stopping";
    case LauncherState::Draining: return "Draining";
    case LauncherState::Done: return "Done";
  }
  return "?";
}

namespace {

/// How long Draining waits for pipes still held open by a process that left its rank's
/// process group (setsid) after every rank has ended. Output already in the pipes is read
/// long before this; it only bounds the wait for writers fsdp-run cannot kill.
constexpr std::chrono::milliseconds kDrainDeadline{1000};

std::string plural_ranks(int n, const char* adjective) {
  return std::to_string(n) + " " + adjective + (n == 1 ? " rank" : " ranks");
}

std::string format_seconds(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", seconds);
  return buf;
}

}  // namespace

Supervisor::Supervisor(JobSpec spec, NodeLink* link) : spec_(std::move(spec)), link_(link) {}

bool Supervisor::restart_possible() const {
  return spec_.topology.restart_count < spec_.topology.max_restarts && !stopped_by_signal_ &&
         !(link_ != nullptr && link_->departed_any());
}

bool Supervisor::nodes_settled() const {
  if (link_ == nullptr) return true;
  // Failed for good: the others were told (or see this launcher gone) and stop anyway, and
  // nothing they say could change this node's outcome. Not waiting also keeps a node that is
  // cut off from the others from waiting out the link's own timeout.
  if (exit_code_ != 0 && !restart_possible()) return true;
  if (link_->is_node0()) return link_->peers_ended();
  return link_->verdict() != Verdict::None || link_->lost_any() || stopped_by_signal_;
}

void Supervisor::conclude() {
  const JobTopology& job = spec_.topology;
  if (link_ == nullptr || link_->is_node0()) {
    restart_ = exit_code_ != 0 && restart_possible();
    if (link_ != nullptr) {
      if (restart_) {
        link_->announce_restart(job.restart_count + 1);
      } else {
        link_->announce_end();
      }
    }
  } else {
    if (link_->verdict() == Verdict::Restart) {
      restart_ = link_->verdict_attempt() == job.restart_count + 1;
      if (!restart_) {
        say("node 0 asked for attempt " + std::to_string(link_->verdict_attempt()) +
            " after attempt " + std::to_string(job.restart_count) +
            "; the launchers disagree (are they the same fsdp-run version?)");
        exit_code_ = 1;
      }
    }
    // Leaving without node 0's word: say so, or node 0 would take this for a lost node.
    if (!restart_ && link_->verdict() == Verdict::None) link_->report_exit();
  }
  if (restart_ || exit_code_ == 0 || stopped_by_signal_ || job.max_restarts == 0) return;
  if (job.restart_count >= job.max_restarts) {
    no_restart_reason_ = "no restart left (--max-restarts " + std::to_string(job.max_restarts) +
                         " used up)";
  } else if (link_ != nullptr && link_->departed_any()) {
    const std::string gone = link_->departed_nodes();
    no_restart_reason_ = link_->lost_any()
                             ? "no restart: the launcher of " + gone + " is gone, and its ranks "
                               "cannot rejoin the job"
                             : "no restart: " + gone + " left the job";
    // The first failure may have been the loss itself, or what it did to the ranks here.
    if (failure_.rfind(gone, 0) == 0) return;
  } else {
    no_restart_reason_ = "no restart: node 0 ended the job";
  }
  if (!failure_.empty()) no_restart_reason_ += "; the job failed: " + failure_;
}

void Supervisor::on_link_event(int fd) {
  if (std::optional<std::string> failure = link_->on_readable(fd)) on_link_failure(*failure);
}

void Supervisor::on_link_failure(const std::string& failure) {
  if (failure_.empty()) failure_ = failure;
  if (state_ == LauncherState::Running) {
    const int running = live_ranks();
    say(failure + (running > 0 ? "; stopping " + plural_ranks(running, "local") : ""));
    begin_stopping(1, SIGTERM);
  } else {
    // Already stopping (or finished): still worth saying, since it may be the cause of what
    // happened here (a peer's ranks died first) or, if our ranks finished, the job did not.
    say(failure);
    if (exit_code_ == 0) exit_code_ = 1;
  }
}

void Supervisor::say(const std::string& line) { stderr_.write_all("fsdp-run: " + line + "\n"); }

int Supervisor::live_ranks() const {
  return static_cast<int>(std::count_if(slots_.begin(), slots_.end(),
                                        [](const auto& s) { return s->process.alive(); }));
}

bool Supervisor::pipes_open() const {
  return std::any_of(slots_.begin(), slots_.end(), [](const auto& s) {
    return s->process.stdout_fd() >= 0 || s->process.stderr_fd() >= 0;
  });
}

void Supervisor::enter(LauncherState to) {
  using S = LauncherState;
  const bool allowed = (state_ == S::Running && (to == S::Stopping || to == S::Draining)) ||
                       (state_ == S::Stopping && to == S::Draining) ||
                       (state_ == S::Draining && to == S::Done);
  if (!allowed) {
    std::fprintf(stderr, "fsdp-run: internal error: launcher cannot go from %s to %s\n",
                 to_string(state_), to_string(to));
    std::abort();
  }
  state_ = to;
  if (to == S::Draining) {
    // See [Note: zombie keeps the group]: every rank is still an unreaped zombie here.
    for (auto& slot : slots_) slot->process.kill_leftovers();
    drain_deadline_ = Clock::now() + kDrainDeadline;
  }
}

int Supervisor::run() {
  start_ranks();
  // Lines that came with node 0's "restart" belong to this attempt.
  if (link_ != nullptr) {
    if (std::optional<std::string> failure = link_->pending()) on_link_failure(*failure);
  }
  while (state_ != LauncherState::Done) {
    advance();
    if (state_ == LauncherState::Done) break;
    wait_for_events();
  }
  finish();
  return exit_code_;
}

void Supervisor::start_ranks() {
  const int n = spec_.topology.nproc_per_node;
  slots_.reserve(static_cast<std::size_t>(n));
  for (int local_rank = 0; local_rank < n; ++local_rank) {
    const int rank = spec_.topology.global_rank(local_rank);
    const std::string prefix = "[rank" + std::to_string(rank) + "]: ";
    slots_.push_back(std::unique_ptr<RankSlot>(
        new RankSlot{RankProcess(rank), LinePrefixer(prefix, stdout_),
                                   LinePrefixer(prefix, stderr_, &repeated_records_)}));
    RankProcess& process = slots_.back()->process;
    std::string failure;
    int code = 0;
    try {
      process.start(spec_.command, rank_environment(environ, spec_.topology, local_rank), signals_);
      if (process.state() == RankState::FailedToStart) {
        failure = "cannot execute '" + spec_.command[0] + "': " + std::strerror(process.exec_errno());
        code = process.launcher_exit_code();
      }
    } catch (const LauncherError& e) {
      failure = e.what();
      code = 1;
    }
    if (process.state() == RankState::Running) orphan_guard_.watch(process.pid());
    if (!failure.empty()) {
      // Every rank runs the same command, so starting the rest would fail the same way.
      const int running = live_ranks();
      say(failure + (running > 0 ? "; stopping " + plural_ranks(running, "started") : ""));
      failure_ = "rank " + std::to_string(rank) + ": " + failure;
      if (link_ != nullptr) link_->report_failure(failure_);
      begin_stopping(code, SIGTERM);
      return;
    }
  }
}

void Supervisor::wait_for_events() {
  // Which pipe each pollfd belongs to: slot index, and whether it is stderr.
  struct Source {
    std::size_t slot;
    bool is_stderr;
  };
  std::vector<pollfd> fds;
  std::vector<Source> sources;
  fds.push_back({signals_.fd(), POLLIN, 0});
  sources.push_back({0, false});
  // The other nodes' connections, marked by an out-of-range slot index.
  constexpr std::size_t kLinkSource = static_cast<std::size_t>(-1);
  if (link_) {
    for (int fd : link_->fds()) {
      fds.push_back({fd, POLLIN, 0});
      sources.push_back({kLinkSource, false});
    }
  }
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    for (bool is_stderr : {false, true}) {
      int fd = is_stderr ? slots_[i]->process.stderr_fd() : slots_[i]->process.stdout_fd();
      if (fd < 0) continue;
      fds.push_back({fd, POLLIN, 0});
      sources.push_back({i, is_stderr});
    }
  }

  // Sleep until something happens, or until the next deadline of the current state.
  int timeout_ms = -1;
  auto until = [&](Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    // Round up so we never wake just before the deadline and spin.
    timeout_ms = static_cast<int>(std::max<long long>(0, left.count() + 1));
  };
  if (state_ == LauncherState::Stopping && !killed_) until(kill_deadline_);
  // Past the drain deadline, node 0 only waits for the other nodes: no deadline to wake for.
  if (state_ == LauncherState::Draining && Clock::now() < drain_deadline_) until(drain_deadline_);

  int ready = ::poll(fds.data(), fds.size(), timeout_ms);
  if (ready <= 0) return;  // timeout, or EINTR (cannot happen: our signals are blocked)

  if (fds[0].revents & POLLIN) {
    for (int sig : signals_.take_pending()) {
      if (sig == SIGCHLD) {
        child_event_ = true;  // advance() finds out which rank
      } else {
        on_signal(sig);
      }
    }
  }
  for (std::size_t k = 1; k < fds.size(); ++k) {
    if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    if (sources[k].slot == kLinkSource) {
      if (link_) on_link_event(fds[k].fd);
    } else {
      relay_output(*slots_[sources[k].slot], sources[k].is_stderr);
    }
  }
}

bool Supervisor::relay_output(RankSlot& slot, bool from_stderr) {
  RankProcess& process = slot.process;
  int fd = from_stderr ? process.stderr_fd() : process.stdout_fd();
  if (fd < 0) return false;
  char buf[64 * 1024];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  LinePrefixer& prefixer = from_stderr ? slot.err : slot.out;
  if (n > 0) {
    prefixer.feed(std::string_view(buf, static_cast<std::size_t>(n)));
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
  // EOF (every writer is gone) or a read error: this stream is over.
  prefixer.finish();
  if (from_stderr) {
    process.close_stderr();
  } else {
    process.close_stdout();
  }
  return false;
}

void Supervisor::on_signal(int sig) {
  if (!is_stop_signal(sig)) return;
  switch (state_) {
    case LauncherState::Running: {
      say("received " + signal_name(sig) + "; forwarding it to " +
          plural_ranks(live_ranks(), "running") + " (SIGKILL after " +
          format_seconds(spec_.grace_seconds) + " s or on a second signal)");
      stopped_by_signal_ = true;
      failure_ = "fsdp-run received " + signal_name(sig);
      // The others stop now rather than when this launcher is gone; no restart follows.
      if (link_ != nullptr) link_->report_failure(failure_ + " (the job stops, no restart)");
      begin_stopping(128 + sig, sig);
      break;
    }
    case LauncherState::Stopping:
      if (!killed_) {
        say("received " + signal_name(sig) + " while stopping; sending SIGKILL to " +
            plural_ranks(live_ranks(), "remaining"));
        kill_all_live(nullptr);
      }
      break;
    case LauncherState::Draining:
      // The user wants out now: stop waiting for leftover writers and for the other nodes
      // (which then see this launcher gone, unless they already finished).
      drain_deadline_ = Clock::now();
      if (link_ != nullptr && !nodes_settled()) {
        link_->leave();
        stopped_by_signal_ = true;
        if (exit_code_ == 0) exit_code_ = 128 + sig;
      }
      break;
    case LauncherState::Done: break;
  }
}

void Supervisor::on_rank_end(RankSlot& slot) {
  // Relay what the rank wrote before it ended (typically its error message), so that it
  // comes before our report of the failure.
  while (relay_output(slot, false)) {
  }
  while (relay_output(slot, true)) {
  }
  const RankProcess& process = slot.process;
  // Only the first failure while Running is reported: ranks ending while Stopping were
  // (most likely) ended by us.
  if (state_ != LauncherState::Running || !process.failed()) return;
  const int others = live_ranks();
  const std::string what = "rank " + std::to_string(process.rank()) + " (pid " +
                           std::to_string(process.pid()) + ") " + process.describe_end();
  say(what + (others > 0 ? "; stopping " + plural_ranks(others, "other") : ""));
  failure_ = what;
  if (link_) link_->report_failure(what);
  begin_stopping(process.launcher_exit_code(), SIGTERM);
}

void Supervisor::begin_stopping(int exit_code, int stop_signal) {
  exit_code_ = exit_code;
  stop_signal_ = stop_signal;
  for (auto& slot : slots_) {
    if (slot->process.state() == RankState::Running) slot->process.stop(stop_signal);
  }
  kill_deadline_ = Clock::now() + std::chrono::milliseconds(
                                      std::llround(spec_.grace_seconds * 1000.0));
  enter(LauncherState::Stopping);
}

void Supervisor::kill_all_live(const char* why) {
  for (auto& slot : slots_) {
    RankProcess& process = slot->process;
    if (process.state() != RankState::Running && process.state() != RankState::Terminating) {
      continue;
    }
    if (why != nullptr) {
      say("rank " + std::to_string(process.rank()) + " (pid " + std::to_string(process.pid()) +
          ") " + why);
    }
    process.kill();
  }
  killed_ = true;
}

void Supervisor::advance() {
  if (child_event_) {
    child_event_ = false;
    for (auto& slot : slots_) {
      if (slot->process.poll_exit()) on_rank_end(*slot);
    }
  }
  // Checked in order, so one call can go Running -> Draining -> Done without sleeping.
  if (state_ == LauncherState::Running && live_ranks() == 0) {
    enter(LauncherState::Draining);  // every rank exited 0, or a failure moved us to Stopping
    if (link_ && !reported_done_) {
      link_->report_done();
      reported_done_ = true;
    }
  }
  if (state_ == LauncherState::Stopping) {
    if (live_ranks() == 0) {
      enter(LauncherState::Draining);
      // Ready for the next attempt; a node stopped by a signal leaves instead.
      if (link_ && !stopped_by_signal_) link_->report_stopped();
    } else if (!killed_ && Clock::now() >= kill_deadline_) {
      const std::string why = "still running " + format_seconds(spec_.grace_seconds) +
                              " s after " + signal_name(stop_signal_) + "; sending SIGKILL";
      kill_all_live(why.c_str());
    }
  }
  if (state_ == LauncherState::Draining) {
    if ((!pipes_open() || Clock::now() >= drain_deadline_) && nodes_settled()) {
      enter(LauncherState::Done);
      conclude();
    }
  }
}

void Supervisor::finish() {
  orphan_guard_.release();  // before reaping: see OrphanGuard::release
  for (auto& slot : slots_) {
    // Streams still open here were cut off by the drain deadline: flush what we have.
    slot->out.finish();
    slot->err.finish();
    slot->process.close_stdout();
    slot->process.close_stderr();
    slot->process.reap();
  }
}

}  // namespace fsdp::launcher
