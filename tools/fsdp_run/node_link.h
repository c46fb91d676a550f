#pragma once
/// Multi-node fsdp-run: the launchers of one job meet on node 0 before any rank starts and stay
/// connected until the end, so that a failure on one node stops every node.
///
/// [Note: node link protocol]
/// One TCP connection from each node r > 0 to node 0's launcher on MASTER_PORT+1 (MASTER_PORT
/// itself is the store's). Newline-terminated text lines:
///   node r -> 0    "hello <nnodes> <nproc> <node_rank> <hostname> <max_restarts>"
///   node 0 -> r    "go" once every node said hello and all agree; otherwise "refuse <why>"
///   either way     "fail <what>"  a rank of the sender's node failed (node 0 relays a node's
///                                 "fail" to every other node), stop now
///   node r -> 0    "done"         every rank of node r exited 0 in this attempt
///                  "stopped"      every rank of node r has ended after a failure (its own or
///                                 one it was told of), so node r is ready to restart
///                  "exit"         node r's launcher exits now without waiting for node 0's
///                                 verdict (its own failure ended the job for it)
///   node 0 -> r    "restart <n>"  every node is done or stopped and restarts are left: start
///                                 attempt n (TORCHELASTIC_RESTART_COUNT=n) now
///                  "end"          no further attempt; each node exits with what it saw
/// A connection that closes without "exit" (from node r) or "end" (from node 0) means that
/// node's launcher died: its peers stop, say so, and the job is not restarted (its ranks could
/// never rejoin); neither is it after an "exit". Node 0 stays up until every node said "done"
/// (or failed), so that no node finishes before the job's outcome is known.
///
/// [Note: restart together] With --max-restarts N, an attempt ends on every node before the
/// next one starts anywhere: each node that can still restart waits, its ranks ended, for
/// node 0's verdict, and node 0 gives it only once every node is done or stopped. All nodes
/// therefore run attempt n with the same TORCHELASTIC_RESTART_COUNT, and no rank of attempt n
/// meets a rank of attempt n-1. Messages of attempt n are sent only after "restart <n>" was
/// received, so each connection's order keeps the attempts apart; a node that reads "restart"
/// and more lines in one go keeps the rest for the next attempt (pending()).

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rank_env.h"

namespace fsdp::launcher {

/// Node 0's decision at the end of an attempt.
enum class Verdict { None, Restart, End };

class NodeLink {
 public:
  /// Blocks until every node joined and agreed (node 0) or node 0 let this node in (others);
  /// throws LauncherError saying what disagreed or who is missing after timeout_seconds.
  /// Nodes must agree on nnodes, nproc_per_node and max_restarts.
  static std::unique_ptr<NodeLink> establish(const JobTopology& job, const std::string& master_addr,
                                             int port, double timeout_seconds);
  ~NodeLink();
  NodeLink(const NodeLink&) = delete;
  NodeLink& operator=(const NodeLink&) = delete;

  bool is_node0() const { return job_.node_rank == 0; }
  /// Connections to poll for reading.
  std::vector<int> fds() const;
  /// Reads what arrived on fd; returns a description of another node's failure or loss.
  std::optional<std::string> on_readable(int fd);
  /// Lines kept back when "restart" arrived together with later lines: processes them as
  /// on_readable would (call once the next attempt's ranks run).
  std::optional<std::string> pending();
  /// This node's ranks failed: `what` names them.
  void report_failure(const std::string& what);
  /// Every rank of this node exited 0.
  void report_done();
  /// Every rank of this node ended after a failure; it can start the next attempt.
  void report_stopped();
  /// This (non-zero) node's launcher exits without waiting for node 0's verdict.
  void report_exit();
  /// Node 0: every other node said "done" or "stopped" this attempt, or is gone.
  /// Other nodes: always true.
  bool peers_ended() const;
  /// Some node's launcher is gone without saying "exit"/"end" (node 0: any other node;
  /// others: node 0).
  bool lost_any() const;
  /// Some node can no longer take part in another attempt: lost, or it said "exit".
  bool departed_any() const;
  /// The lost nodes (or, if none, those that said "exit"): "node 1 (simhost1, ranks 2-3)",
  /// comma-separated.
  std::string departed_nodes() const;
  /// Node 0: tells every other node to start attempt `attempt` / that the job is over.
  void announce_restart(int attempt);
  void announce_end();
  /// Other nodes: what node 0 decided for this attempt (None: not yet); for Restart, the
  /// attempt it named is verdict_attempt().
  Verdict verdict() const { return verdict_; }
  int verdict_attempt() const { return verdict_attempt_; }
  /// Forgets this attempt's "done"/"stopped"/verdict: the next attempt starts.
  void begin_attempt();
  /// Closes every connection: the other nodes see this launcher gone.
  void leave();

 private:
  struct Peer {
    int fd = -1;
    int node_rank = -1;
    std::string host;
    std::string buffer;  // bytes received after the last complete line
    bool done = false;
    bool stopped = false;
    bool exited = false;  // it said "exit"
    bool closed = false;  // no more reading: gone, or this launcher left
    bool lost = false;    // its launcher went away unannounced (no "exit" or "end")
  };
  NodeLink(JobTopology job, std::vector<Peer> peers);
  void send_to(Peer& peer, const std::string& line);
  /// Handles the complete lines in peer.buffer, up to and including a verdict.
  std::optional<std::string> take_lines(Peer& peer);
  /// "node 1 (simhost1, ranks 2-3)"
  std::string describe(const Peer& peer) const;

  JobTopology job_;
  std::vector<Peer> peers_;  // node 0: every other node; others: node 0 only
  Verdict verdict_ = Verdict::None;
  int verdict_attempt_ = -1;
};

}  // namespace fsdp::launcher
