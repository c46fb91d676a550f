#pragma once
/// Process groups: bootstrap from the environment, rendezvous, backend choice,
/// sub-groups and timeouts. See [Note: groups and stores] in process_group.cpp.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include "fsdp/comm/launch_env.h"
#include "fsdp/comm/types.h"

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace fsdp::comm {

namespace detail {
class ShmChannel;
class Transport;
class FlightRecorder;
class GroupDesc;
}  // namespace detail

/// Options of init_process_group (libtorch style: chained setters).
struct InitOptions {
  TORCH_ARG(Backend, backend) = Backend::kAuto;
  /// Applies to the rendezvous and to every collective issued through this group.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// Explicit placement; each field set overrides the environment.
  TORCH_ARG(LaunchOverrides, overrides) = {};
  /// Rendezvous through a file instead of TCP (tests, shared file systems).
  TORCH_ARG(std::string, file_store_path) = "";
  /// Key prefix inside the store (distinct jobs sharing one store).
  TORCH_ARG(std::string, store_prefix) = "";
  /// When every rank of a group runs on this host, its all-gathers, reduce-scatters and
  /// all-reduces go through shared memory (/dev/shm) instead of Gloo's loopback TCP:
  /// same results, a fraction of the CPU time. Groups spanning hosts, or whose ranks
  /// cannot map each other's segments, use Gloo. Sub-groups inherit this setting. The
  /// environment variable FSDP_SHARED_MEMORY=0 turns it off as well; FSDP_SHM_SLOT_KIB
  /// sets the size of a ring slot in KiB (tuning, default 256; every rank must use the
  /// same); FSDP_SHM_DIRECT=0 stops this rank publishing fragments in place from its
  /// exchange arena (comm::allocate_collective_buffer), so that they are copied through
  /// the rings (for comparisons). All are read once, here.
  TORCH_ARG(bool, shared_memory) = true;
  /// The CUDA device this rank binds: -1 takes its local rank modulo the visible devices.
  TORCH_ARG(int, device_index) = -1;
  /// Checked mode: before each collective, every rank compares its op, dtype, size and label
  /// with the others' through the store (not the transport being checked), so a rank that
  /// issues another collective fails at once, naming the divergence, instead of at the
  /// timeout. Costs a store round trip per collective: for finding a hang, not for training.
  /// FSDP_CHECK_COLLECTIVES=1 turns it on too. Sub-groups inherit it.
  TORCH_ARG(bool, check_collectives) = false;
};

/// A process group and this rank's place in it. Cheap to copy (shared state).
/// Every collective issued through fsdp::comm uses `timeout()`.
class ProcessGroup {
 public:
  ProcessGroup() = default;
  ProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::Store> store,
               std::string name, std::vector<int> global_ranks, LaunchEnv env,
               std::chrono::milliseconds timeout);

  bool defined() const { return state_ != nullptr; }
  int rank() const;        ///< rank inside this group
  int size() const;        ///< number of ranks in this group
  int global_rank() const; ///< rank in the world group
  int local_rank() const;  ///< rank on this machine (from the launcher)
  int local_world_size() const;
  const std::string& name() const;   ///< "world" or "world/sub<k>[...]"
  const std::vector<int>& global_ranks() const;  ///< member i -> world rank
  std::chrono::milliseconds timeout() const;
  const LaunchEnv& launch_env() const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& c10d() const;
  const c10::intrusive_ptr<c10d::Store>& store() const;

  /// Builds a group over `world_ranks` (ranks of *this* group, ascending). Collective
  /// over this group: every member calls it in the same order with the same list,
  /// and non-members call it too (they get an undefined group back), as in
  /// torch.distributed.new_group.
  ProcessGroup new_subgroup(std::vector<int> ranks);
  friend ProcessGroup init_process_group(const InitOptions& options);
  /// Splits into consecutive blocks of `group_size` ranks ({0..g-1}, {g..2g-1}, ...)
  /// and returns this rank's block. Collective over this group.
  ProcessGroup split_consecutive(int group_size);
  /// Groups of ranks holding the same index inside their block ({i, i+g, i+2g, ...}).
  ProcessGroup split_strided(int group_size);

  /// What the group's transports know of it (rank, size, name, timeout, store, peers).
  /// Internal to fsdp::comm.
  const detail::GroupDesc& desc() const;
  /// The group's shared-memory transport, or nullptr when it uses Gloo only
  /// (see InitOptions::shared_memory). Internal to fsdp::comm.
  const std::shared_ptr<detail::ShmChannel>& shm_channel() const;
  /// How this group's collectives move data, chosen when the group was created (see
  /// [Note: transports] in src/comm/transport.h). Internal to fsdp::comm.
  const std::shared_ptr<detail::Transport>& transport() const;
  /// How this group's CUDA tensors move (NCCL or Gloo), or nullptr when the world moves
  /// none (see Backend). Internal to fsdp::comm.
  const std::shared_ptr<detail::Transport>& device_transport() const;
  /// The CUDA device this rank is bound to, -1 when the world moves no CUDA tensors.
  int cuda_device() const;
  /// The backend of CUDA tensors: NCCL or Gloo; Auto when there is none.
  Backend cuda_backend() const;

  /// Host and pid of a member, as published at rendezvous (for error messages).
  std::string describe_peer(int rank) const;
  /// Names ranks of this group that can be known to be gone (same host, pid dead).
  std::string dead_peers_hint() const;
  /// True when member `rank` ran on this host and its process has exited.
  bool peer_gone(int rank) const;
  /// InitOptions::check_collectives (or FSDP_CHECK_COLLECTIVES=1) of its world.
  bool checks_collectives() const;
  /// This group's record of its recent collectives (src/comm/flight_recorder.h).
  detail::FlightRecorder& flight_recorder() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

/// Bootstraps the world group from the launcher's environment (see launch_env.h)
/// or from explicit values. Ranks agree on the world size (mismatch: error on every
/// rank naming both values) and publish host/pid for error messages.
ProcessGroup init_process_group(const InitOptions& options = {});

}  // namespace fsdp::comm
