#pragma once
/// Runs one job: starts the ranks, relays their output, watches for exits and signals, and
/// stops the job when a rank fails or fsdp-run is asked to stop. One thread, one poll() loop.
///
/// [Note: launcher states]
///
///   Running --rank failed / rank could not start / stop signal--> Stopping
///   Running --every rank exited 0-------------------------------> Draining
///   Stopping --every rank ended---------------------------------> Draining
///   Draining --every pipe at EOF, or drain deadline, and every--> Done
///              other node done (node 0 of a multi-node job)
///
///   Running   all ranks run; nothing has gone wrong yet.
///   Stopping  the stop signal went to every live rank's process group; SIGKILL follows at
///             the end of the grace period, or at once on another stop signal. The exit code
///             is fixed on entry: the failing rank's, or 128+signal.
///   Draining  no rank is left; output already in the pipes is still relayed, and anything
///             left in the ranks' process groups (background children that inherited the
///             pipes) is killed, since nothing of the job may outlive fsdp-run. A short
///             deadline bounds the wait for a leftover that escaped its group (setsid).
///   Done      every partial line flushed, every rank reaped.
///
/// Multi-node (NodeLink): a failure reported by another node, or the loss of its launcher,
/// acts like a failed local rank (Running -> Stopping, exit code 1); this node's own first
/// failure is reported to the others; node 0 leaves Draining only once every other node
/// finished, so that no node takes node 0's normal exit for a loss.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "line_prefixer.h"
#include "node_link.h"
#include "orphan_guard.h"
#include "rank_env.h"
#include "rank_process.h"
#include "signals.h"

namespace fsdp::launcher {

struct JobSpec {
  std::vector<std::string> command;
  JobTopology topology;
  /// Seconds between the stop signal and SIGKILL.
  double grace_seconds = 3.0;
};

enum class LauncherState { Running, Stopping, Draining, Done };
const char* to_string(LauncherState state);

class Supervisor {
 public:
  /// `link` is null for a single-node job.
  explicit Supervisor(JobSpec spec, std::unique_ptr<NodeLink> link = nullptr);
  /// Runs the job to the end; returns fsdp-run's exit code.
  int run();
  /// After run(): the job ended because fsdp-run itself got a stop signal (no restart then).
  bool stopped_by_signal() const { return stopped_by_signal_; }

 private:
  using Clock = std::chrono::steady_clock;

  /// One rank with the two streams its output goes through.
  struct RankSlot {
    RankProcess process;
    LinePrefixer out;
    LinePrefixer err;
  };

  void start_ranks();
  void wait_for_events();
  /// Reads once from one of the rank's pipes; returns true if bytes came.
  bool relay_output(RankSlot& slot, bool from_stderr);
  void on_signal(int sig);
  void on_rank_end(RankSlot& slot);
  void on_link_event(int fd);
  /// Draining may end: node 0 of a multi-node job also waits for the other nodes.
  bool nodes_settled() const;
  void begin_stopping(int exit_code, int stop_signal);
  void kill_all_live(const char* why);
  void advance();
  void enter(LauncherState to);
  void finish();
  int live_ranks() const;
  bool pipes_open() const;
  void say(const std::string& line);

  JobSpec spec_;
  std::unique_ptr<NodeLink> link_;
  bool reported_done_ = false;
  bool stopped_by_signal_ = false;
  SignalInbox signals_;
  OrphanGuard orphan_guard_;  // kills the ranks' groups if fsdp-run dies before finish()
  OutputStream stdout_{1};
  OutputStream stderr_{2};
  std::vector<std::unique_ptr<RankSlot>> slots_;
  LauncherState state_ = LauncherState::Running;
  int exit_code_ = 0;
  Clock::time_point kill_deadline_;  // Stopping: when SIGKILL follows the stop signal
  bool killed_ = false;              // Stopping: SIGKILL already sent
  int stop_signal_ = SIGTERM;        // Stopping: what the ranks were sent first
  Clock::time_point drain_deadline_;
  /// A SIGCHLD arrived since ranks were last checked (true at first: a rank may have ended
  /// while the others were being started). Saves N waitid calls per burst of output.
  bool child_event_ = true;
};

}  // namespace fsdp::launcher
