#pragma once
/// Runs one job: starts the ranks, relays their output, watches for exits and signals, and
/// stops the job when a rank fails or fsdp-run is asked to stop. One thread, one poll() loop.
///
/// [Note: launcher states]
///
///   Running --rank failed / rank could not start / stop signal--> Stopping
///   Running --every rank exited 0-------------------------------> Draining
///   Stopping --every rank ended---------------------------------> Draining
///   Draining --every pipe at EOF, or drain deadline, and the----> Done
///              nodes settled (multi-node, below)
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
/// failure (or stop signal) is reported to the others. Entering Draining, a node says "done"
/// (from Running) or "stopped" (from Stopping). The nodes are settled when this node failed
/// and cannot restart (the others were told and stop anyway), or else:
///   node 0  every other node is done or stopped (or gone);
///   node r  node 0's verdict arrived, or node 0 is gone, or fsdp-run was signalled.
/// On Done, node 0 announces the verdict: restart when the attempt failed, restarts are left,
/// no stop signal came and no launcher is gone; otherwise end. See [Note: restart together].

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
  /// Runs one attempt (spec.topology.restart_count). `link` is null for a single-node job;
  /// it outlives the supervisor, which uses it for this attempt only.
  explicit Supervisor(JobSpec spec, NodeLink* link = nullptr);
  /// Runs the attempt to the end; returns fsdp-run's exit code for it.
  int run();
  /// After run(): start the next attempt (all nodes do, together).
  bool restart() const { return restart_; }
  /// After run() of a failed attempt that is not restarted: why not (empty if there is
  /// nothing to add, e.g. restarts were never asked for or a stop signal ended the job).
  const std::string& no_restart_reason() const { return no_restart_reason_; }

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
  void on_link_failure(const std::string& failure);
  /// Draining may end as far as the other nodes are concerned (see the class note).
  bool nodes_settled() const;
  /// A failed attempt may be followed by another: restarts left, no stop signal, no lost node.
  bool restart_possible() const;
  /// On Done: decides (node 0, one node) or reads (other nodes) whether to restart.
  void conclude();
  void begin_stopping(int exit_code, int stop_signal);
  void kill_all_live(const char* why);
  void advance();
  void enter(LauncherState to);
  void finish();
  int live_ranks() const;
  bool pipes_open() const;
  void say(const std::string& line);

  JobSpec spec_;
  NodeLink* link_;
  bool reported_done_ = false;
  bool stopped_by_signal_ = false;
  bool restart_ = false;
  std::string failure_;  // the attempt's first failure, as reported
  std::string no_restart_reason_;
  SignalInbox signals_;
  OrphanGuard orphan_guard_;  // kills the ranks' groups if fsdp-run dies before finish()
  OutputStream stdout_{1};
  OutputStream stderr_{2};
  RepeatedRecordFilter repeated_records_;  // the flight recorder's divergence, once per job
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
