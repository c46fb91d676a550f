#pragma once
// Internal to src/comm: how a group's collectives move data.
//
// [Note: transports]
// collectives.cpp checks the arguments of a collective (shapes, dtypes, aliasing, roots),
// handles what is the same everywhere (a group of one rank, bf16 all-reduce summed in
// fp32, the byte counters), and hands the call to the group's transport. A transport is
// chosen once per group, when the group is created (make_transport below), from where its
// ranks run; the algorithm is chosen per call, inside the transport, from the call's size
// and the process-wide knobs of collectives.h (comm_tuning.h):
//   GlooTransport (gloo_transport.h): any group. All-gather and reduce-scatter over Gloo's
//     alltoall for small flat buffers at N >= 3, else over segmented send/recv; all-reduce,
//     broadcast and barrier are Gloo's own.
//   ShmTransport (shm_transport.h): a group whose ranks all run on this host and map each
//     other's segments. All-gather, reduce-scatter and all-reduce through shared memory
//     (shm_channel.h); broadcast and barrier, and every call while
//     set_comm_shared_memory(false), through the group's GlooTransport, which it holds.
// The shared-memory progress engine (shm_engine.h) is shared by the transports of one
// world: the channels register with it, and GlooTransport's waits move it while it has
// pending work, so a rank blocked on any group keeps feeding its peers on every other.
//
// Multi-host groups (not built yet). A group spanning hosts gets a GlooTransport today.
// When its ranks come in same-host blocks (HYBRID_SHARD's world group, FULL_SHARD across
// hosts), a composite would do better: a HierarchicalTransport built here when the peer
// table shows several ranks per host, holding a ShmTransport over this host's ranks of
// the group and a GlooTransport over the ranks of the other hosts holding the same local
// index (one sub-group of each kind, created collectively in make_transport). All-reduce
// becomes shm reduce-scatter -> Gloo all-reduce of this rank's chunk across hosts -> shm
// all-gather; all-gather and reduce-scatter compose the same way (Gloo across hosts on
// 1/local_size of the data, shared memory inside). It implements this interface, so
// collectives.cpp does not change; it shares the world's engine, so its Gloo waits keep
// the progress guarantee. One thing it cannot keep as is: its sums add per-host partial
// sums, not the N rows in rank order, so its results would match the flat transports'
// within rounding, not bit for bit (rank-order-preserving variants move more data).
// Groups inside one host (HYBRID_SHARD's shard group) stay on
// ShmTransport and groups with one rank per host (its replica group) on GlooTransport.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"

namespace c10d {
class Work;
}

namespace fsdp::comm::detail {

class ShmArena;
class ShmEngine;

/// One group's data movement. Every call is made by collectives.cpp with arguments it has
/// already checked, on a group of at least two ranks, on every member in the same order.
/// A transport does not count bytes (collectives.cpp does, the same for every transport).
class Transport {
 public:
  virtual ~Transport() = default;

  /// Fills every chunk of `flat` (this rank's too) with the matching rank's shard. `shard`
  /// is either disjoint from `flat` or exactly this rank's chunk of it.
  virtual CommHandle all_gather(const ProcessGroup& g, const at::Tensor& flat, const at::Tensor& shard) = 0;
  /// out = sum (or mean) in rank order of every rank's chunk `rank` of `flat`. `out` may
  /// overlap `flat`. op is Sum or Avg.
  virtual CommHandle reduce_scatter(const ProcessGroup& g, const at::Tensor& out, const at::Tensor& flat,
                                    ReduceOp op) = 0;
  /// In place over every rank's `t`. Never bf16 (collectives.cpp widens it first).
  virtual CommHandle all_reduce(const ProcessGroup& g, const at::Tensor& t, ReduceOp op) = 0;
  /// In place from `root`.
  virtual CommHandle broadcast(const ProcessGroup& g, const at::Tensor& t, int root) = 0;
  /// Blocks until every member arrives.
  virtual void barrier(const ProcessGroup& g) = 0;
  /// Blocks until `work`, a c10d work of this group's `op`, completes, or fails with a
  /// message naming op, group, rank and peers after the group's timeout. Pending
  /// shared-memory operations of the world keep moving meanwhile.
  virtual void wait(const c10::intrusive_ptr<c10d::Work>& work, const ProcessGroup& g,
                    const std::string& op) = 0;
  /// Memory that this transport's peers read in place when a collective's source lies
  /// in it; an empty DataPtr when it has none (comm::allocate_collective_buffer falls
  /// back to ordinary memory).
  virtual at::DataPtr allocate_direct(size_t /*nbytes*/) { return {}; }
  /// Every member's exchange arena by group rank, for a mapped flat buffer ([Note: mapped
  /// flat buffer] in include/fsdp/comm/mapped_flat.h); empty when this transport has none.
  virtual std::vector<std::shared_ptr<ShmArena>> exchange_arenas() const { return {}; }
};

/// Slots of 256 KiB: big enough that the per-piece handshake (two atomics, maybe a futex
/// wake) is noise next to the copy, small enough that a piece is still in cache when its
/// reader takes it.
constexpr int64_t kDefaultShmSlotBytes = int64_t(256) << 10;

/// What init_process_group decided for the transports of its world, once (from
/// InitOptions and the environment); sub-groups inherit it.
struct TransportConfig {
  /// InitOptions::shared_memory, and FSDP_SHARED_MEMORY is not "0".
  bool shared_memory = false;
  /// Slot size of the shared-memory rings: FSDP_SHM_SLOT_KIB (tuning; every rank must
  /// agree, or the group falls back to Gloo naming the mismatch), else the default.
  int64_t shm_slot_bytes = kDefaultShmSlotBytes;
  /// Pieces that lie in the exchange arena are read by peers in place (FSDP_SHM_DIRECT
  /// is not "0"; [Note: exchange arena] in shm_arena.cpp).
  bool shm_direct = true;
  /// InitOptions::check_collectives, or FSDP_CHECK_COLLECTIVES=1 (collective_check.h).
  bool check_collectives = false;
};

/// The transport of the new group `g` (rank, size, name, store and peer table set).
/// Collective over `g` when shared memory is on: the members agree on it through the
/// group's store. `engine` is the world's (nullptr when shared memory is off).
std::shared_ptr<Transport> make_transport(const ProcessGroup& g, const TransportConfig& config,
                                          const std::shared_ptr<ShmEngine>& engine);

}  // namespace fsdp::comm::detail
