#pragma once
/// Multi-node fsdp-run: the launchers of one job meet on node 0 before any rank starts and stay
/// connected until the end, so that a failure on one node stops every node.
///
/// [Note: node link protocol]
/// One TCP connection from each node r > 0 to node 0's launcher on MASTER_PORT+1 (MASTER_PORT
/// itself is rank 0's store). Newline-terminated text lines:
///   node r -> 0    "hello <nnodes> <nproc> <node_rank> <hostname>"
///   node 0 -> r    "go" once every node said hello and all agree; otherwise "refuse <why>"
///   either way     "fail <what>"  a rank of the sender's node failed (node 0 relays a node's
///                                 "fail" to every other node), stop now
///                  "done"         every rank of the sender's node exited 0
/// A connection that closes before "done" means that node's launcher died: its peers stop.
/// Node 0 stays up until every node said "done" (or failed), so a node that finishes first
/// never mistakes node 0's normal exit for a failure.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rank_env.h"

namespace fsdp::launcher {

class NodeLink {
 public:
  /// Blocks until every node joined and agreed (node 0) or node 0 let this node in (others);
  /// throws LauncherError saying what disagreed or who is missing after timeout_seconds.
  static std::unique_ptr<NodeLink> establish(const JobTopology& job, const std::string& master_addr,
                                             int port, double timeout_seconds);
  ~NodeLink();
  NodeLink(const NodeLink&) = delete;
  NodeLink& operator=(const NodeLink&) = delete;

  /// Connections to poll for reading.
  std::vector<int> fds() const;
  /// Reads what arrived on fd; returns a description of another node's failure or loss.
  std::optional<std::string> on_readable(int fd);
  /// This node's ranks failed: `what` names them.
  void report_failure(const std::string& what);
  /// Every rank of this node exited 0.
  void report_done();
  /// Node 0: every other node said "done" or is gone (a loss was reported by on_readable).
  /// Other nodes: always true.
  bool peers_done() const;

 private:
  struct Peer {
    int fd = -1;
    int node_rank = -1;
    std::string host;
    std::string buffer;  // bytes received after the last complete line
    bool done = false;
    bool closed = false;
  };
  NodeLink(JobTopology job, std::vector<Peer> peers);
  void send_to(Peer& peer, const std::string& line);
  std::string describe(const Peer& peer) const;

  JobTopology job_;
  std::vector<Peer> peers_;  // node 0: every other node; others: node 0 only
};

}  // namespace fsdp::launcher
