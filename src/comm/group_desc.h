#pragma once
// Internal to src/comm: what a transport knows of its group.
//
// [Note: group descriptor]
// The transports (shm/, gloo/, device/) sit below ProcessGroup: they move one group's bytes
// and word their failures, for which they need the facts below and nothing else of the
// group (not its sub-groups, its other transport or its flight recorder). ProcessGroup makes
// one descriptor when it is made and passes it with every call to its transports, which keep
// copies for as long as a call is in flight; copies share one set of facts.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace fsdp::comm::detail {

/// Where a rank runs, as it published at rendezvous (for error messages).
struct Peer {
  std::string host;
  int pid = 0;
};

class GroupDesc {
 public:
  struct Facts {
    /// The group's c10d process group: Gloo for CPU tensors, NCCL or Gloo for CUDA ones.
    c10::intrusive_ptr<c10d::ProcessGroup> c10d;
    c10::intrusive_ptr<c10d::Store> store;  ///< the job's root store (unprefixed)
    std::string name;                        ///< "world" or "world/sub<k>[...]"
    std::vector<int> global_ranks;           ///< member i -> world rank
    int global_rank = 0;                     ///< this process's world rank
    std::chrono::milliseconds timeout{0};
  };
  GroupDesc() = default;
  explicit GroupDesc(Facts facts);

  int rank() const { return facts_->rank; }  ///< inside the group
  int size() const { return facts_->size; }
  int global_rank() const { return facts_->facts.global_rank; }
  const std::string& name() const { return facts_->facts.name; }
  std::chrono::milliseconds timeout() const { return facts_->facts.timeout; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return facts_->facts.store; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& c10d() const { return facts_->facts.c10d; }
  const std::vector<int>& global_ranks() const { return facts_->facts.global_ranks; }

  /// The world's peer table, by world rank, shared by every group of the world. Set once,
  /// while the group is made (before any transport has it); a group made by the public
  /// ProcessGroup constructor has none, and its messages name ranks only.
  void set_world_peers(std::shared_ptr<const std::vector<Peer>> peers);
  const std::shared_ptr<const std::vector<Peer>>& world_peers() const { return facts_->world_peers; }

  /// "rank 1 (world rank 3) [pid 812 on node7]": a member, for error messages.
  std::string describe_peer(int rank) const;
  /// "; gone: rank 1 [...]" naming the members known to be gone (same host, pid dead), or "".
  std::string dead_peers_hint() const;
  /// True when member `rank` ran on this host and its process has exited.
  bool peer_gone(int rank) const;

 private:
  struct Shared {
    Facts facts;
    int rank = 0, size = 0;  // read once from the c10d group
    std::shared_ptr<const std::vector<Peer>> world_peers;
  };
  // The peer table may be set after copies exist (only while the group is made), so the
  // copies share one mutable block.
  std::shared_ptr<Shared> facts_;
};

/// This machine's host name ("?" when it has none), as the peer table records it.
std::string this_host_name();

}  // namespace fsdp::comm::detail
