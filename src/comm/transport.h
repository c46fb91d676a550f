#pragma once
// Internal to src/comm: how a group's collectives move data. The floor the wires (shm/,
// gloo/, device/) build on: it speaks the words of fsdp/comm/types.h and the group
// descriptor (group_desc.h), never the collectives API or ProcessGroup above it.
//
// [Note: transports]
// collectives.cpp checks the arguments of a collective (shapes, dtypes, aliasing, roots),
// handles what is the same everywhere (a group of one rank, bf16 all-reduce summed in
// fp32, the byte counters), and hands the call to the group's transport. A transport is
// chosen once per group, when the group is created (transport_factory.h), from where its
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
// hosts), a composite would do better: a HierarchicalTransport made by the factory when
// the peer table shows several ranks per host, holding a ShmTransport over this host's ranks of
// the group and a GlooTransport over the ranks of the other hosts holding the same local
// index (one sub-group of each kind, created collectively by the factory). All-reduce
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
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <torch/csrc/distributed/c10d/Work.hpp>  // Issued's destructor needs the whole type

#include "fsdp/comm/types.h"
#include "group_desc.h"

namespace fsdp::comm::detail {

/// What a transport hands back for a collective it issued, before anyone waits (as FSDP2's
/// collectives return a result object): the backend's work if there is one, which the
/// transport's wait() completes, then `finish`, which does what is left on this rank (the
/// sums, the copies, the shared-memory wait). The choke point (collective_call.h) wraps it
/// in the caller's CommHandle.
struct Issued {
  c10::intrusive_ptr<c10d::Work> work;  ///< null when `finish` does all the waiting
  std::function<void()> finish;
  CommPath path = CommPath::kLocal;
  bool on_device = false;  ///< `work` is waited by the group's device transport
};

/// A flat buffer's address range whose chunks are the members' own memory ([Note: mapped
/// flat buffer] in include/fsdp/comm/mapped_flat.h). Made by Transport::map_flat.
class FlatMapping {
 public:
  virtual ~FlatMapping() = default;
  /// size * chunk_bytes bytes, read-only but for the seam pages.
  virtual char* data() const = 0;
  /// Copies every member's current bytes of the seam pages.
  virtual void copy_seams() const = 0;
  /// Bytes of the private seam pages (what the mapping holds beyond the chunks).
  virtual int64_t seam_bytes() const = 0;
};

/// This rank's chunk of a mapped flat buffer, in memory its peers can map, and where it
/// lies there (what the members exchange before Transport::map_flat).
struct MappableChunk {
  at::DataPtr memory;   ///< empty when the transport has no such memory, or it is full
  int64_t offset = -1;  ///< of `memory` in this rank's mappable memory; -1 when empty
};

/// One group's data movement. Every call is made by collectives.cpp with arguments it has
/// already checked, on a group of at least two ranks, on every member in the same order.
/// A transport does not count bytes (collectives.cpp does, the same for every transport).
class Transport {
 public:
  virtual ~Transport() = default;

  /// Fills every chunk of `flat` (this rank's too) with the matching rank's shard. `shard`
  /// is either disjoint from `flat` or exactly this rank's chunk of it.
  virtual Issued all_gather(const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard) = 0;
  /// out = sum (or mean) in rank order of every rank's chunk `rank` of `flat`. `out` may
  /// overlap `flat`. op is Sum or Avg.
  virtual Issued reduce_scatter(const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat,
                                ReduceOp op) = 0;
  /// In place over every rank's `t`. Never bf16 (collectives.cpp widens it first).
  virtual Issued all_reduce(const GroupDesc& g, const at::Tensor& t, ReduceOp op) = 0;
  /// In place from `root`.
  virtual Issued broadcast(const GroupDesc& g, const at::Tensor& t, int root) = 0;
  /// Blocks until every member arrives.
  virtual void barrier(const GroupDesc& g) = 0;
  /// Blocks until `work`, a c10d work of this group's `op`, completes, or fails with a
  /// message naming op, group, rank and peers after the group's timeout. Pending
  /// shared-memory operations of the world keep moving meanwhile.
  virtual void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupDesc& g, const std::string& op) = 0;
  /// Memory that this transport's peers read in place when a collective's source lies
  /// in it; an empty DataPtr when it has none (comm::allocate_collective_buffer falls
  /// back to ordinary memory).
  virtual at::DataPtr allocate_direct(size_t /*nbytes*/) { return {}; }
  /// This rank's chunk of `chunk_bytes` of a mapped flat buffer; empty where this transport
  /// has no memory its peers map (then no member maps: MappedFlat::create).
  virtual MappableChunk allocate_mappable_chunk(const GroupDesc& /*g*/, int64_t /*chunk_bytes*/) { return {}; }
  /// The mapped flat buffer over every member's chunk, member r's at `offsets[r]` (its
  /// allocate_mappable_chunk's offset); called only once every member has one.
  virtual std::unique_ptr<FlatMapping> map_flat(std::vector<int64_t> /*offsets*/, int64_t /*chunk_bytes*/) {
    return nullptr;
  }
};

}  // namespace fsdp::comm::detail
