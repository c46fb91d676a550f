#pragma once
/// The environment a rank starts with: fsdp-run's own, plus exactly the variables torchrun
/// sets (standalone, or static multi-node rendezvous), so a program (and fsdp::comm::parse_launch_env) cannot tell the
/// two launchers apart.

#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp::launcher {

/// A failure of fsdp-run itself (not of a rank); main prints it and exits 1.
struct LauncherError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// What every rank of one job shares.
struct JobTopology {
  /// Ranks per node (every node runs the same number).
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  /// --max-restarts, and how many times the ranks were restarted so far.
  int max_restarts = 0;
  int restart_count = 0;
  int world_size() const { return nnodes * nproc_per_node; }
  /// The global rank of this node's local rank `local_rank`.
  int global_rank(int local_rank) const { return node_rank * nproc_per_node + local_rank; }
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  /// Node 0's fsdp-run serves the store on master_port (agent_store.h), not rank 0.
  bool agent_store = false;
};

/// `base` is fsdp-run's own environment (environ). Variables fsdp-run sets replace any
/// inherited value, except OMP_NUM_THREADS, which is only defaulted to 1 (as torchrun does):
/// N ranks each using every core would oversubscribe the machine N times.
std::vector<std::string> rank_environment(const char* const* base, const JobTopology& job,
                                          int local_rank);

/// A port that was free a moment ago: bind port 0 on loopback, read the port the kernel chose,
/// close. Rank 0 binds it again shortly after; another process could take it in between, which
/// torchrun accepts too. Throws LauncherError if no socket can be bound.
int pick_free_port();

}  // namespace fsdp::launcher
