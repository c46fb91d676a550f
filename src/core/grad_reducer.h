#pragma once
// Gradient reduction of one Runtime: which units are reduced together (buckets)
// and the reductions in flight.
//
// [Note: reduce buckets]
// A *bucket* is a run of consecutive units of the reduction order (reverse
// pre-forward; [Note: collective order] in runtime.h) whose flat gradients one
// collective reduces (Options::bucket_cap_mb, FairScale's semantics). Members
// share their kind (sharded or not) and reduce dtype. A sharded member's flat
// gradient is N *rows*, its chunks for the N ranks of the reduce group ([Note:
// padded flat buffer]); the bucket's buffer is [N, sum of the members' chunks],
// row r the concatenation of every member's chunk r, so one reduce-scatter leaves
// on rank r the concatenation of every member's shard r. An unsharded member is
// one row (its whole flat gradient) and the bucket one all-reduce. Every element
// is the sum of the same values as without buckets; reduce_scatter adds rows
// 0..N-1 in rank order at any position, so its results are bit-identical
// (Gloo's ring all-reduce picks the order by position: bit-identical at 2 ranks,
// equal to rounding above).
//
// Who joins: a unit whose flat gradient fits the open bucket (same kind and
// dtype, bucket bytes + its bytes <= cap) joins it; otherwise the open bucket is
// issued first. A unit whose flat gradient alone is >= cap (every unit when the
// cap is <= 0) is issued alone at once. The end-of-backward callback issues what
// is left. Membership depends only on the order, the units' sizes and dtypes and
// no_sync, which every rank shares, so every rank forms the same buckets and
// issues the same collectives in the same order; an unused branch on one rank
// only changes *when* a bucket fills there. A bucket of one unit is exactly the
// unbucketed reduction: the unit's own flat gradient, no copy.
//
// Reductions in flight. Every issued bucket is a Reduction in one of two windows
// ([Note: reductions in flight] in src/engine/reduction_window.h):
//   SCATTERING   its collective over the reduce group is in flight
//   REPLICATING  (HYBRID_SHARD) the all-reduce of its output over the replica
//                group is in flight ([Note: hybrid groups] in comm_context.h)
//   DONE         its members hold their reduced shards (Unit::adopt_reduced_shard)
// At most max_scattering reductions are SCATTERING: when the window is full the
// oldest is completed before the next is issued (make_room: before the unit
// whose arrival issues it even flattens its gradients), so backward holds a
// bounded number of flat gradients instead of the whole model's. Sharded
// strategies use a window of one: the flat gradient is transient, and one
// more in flight costs a unit's memory. NO_SHARD uses two: its flat gradient
// *is* the gradient kept after the step, so a second all-reduce in flight costs
// nothing, and the main thread no longer waits for one unit's all-reduce
// before it can flatten and issue the next (measured in docs/benchmarks.md,
// bench_strategies). Collectives complete in the order issued. Under
// HYBRID_SHARD with more than one replica, a reduction's replica all-reduce is
// issued by the ReplicaChain's thread as soon as its reduce-scatter completes
// ([Note: replica chain] in replica_chain.h); leaving SCATTERING on the
// backward thread takes that all-reduce back (REPLICATING, a window without a
// bound). Every REPLICATING reduction (each holds only its shard-sized output,
// which becomes the gradient pieces anyway) is completed at the end of backward,
// oldest first, before any gradient piece is assigned, so backward never waits
// for the link.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "engine/bucket_former.h"
#include "engine/reduction_window.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/trace.h"
#include "memory/buffer_pool.h"
#include "replica_chain.h"
#include "stream_order.h"

namespace fsdp::core::detail {

class Unit;

class GradReducer {
 public:
  /// replica_group: undefined or of size 1 unless HYBRID_SHARD replicates.
  /// cap_bytes <= 0: every unit is reduced alone. A bucket's input buffer comes
  /// from `pool` ([Note: buffer pool]), like the flat gradients it concatenates.
  /// max_scattering: reductions whose collective may be in flight at once
  /// ([Note: reductions in flight]). streams: the runtime's stream order ([Note: stream
  /// order wiring] in runtime.h), or null.
  GradReducer(comm::ProcessGroup reduce_group, comm::ProcessGroup replica_group, int64_t cap_bytes,
              Tracer* tracer, memory::BufferPool* pool, int max_scattering, StreamOrder* streams = nullptr);
  ~GradReducer();

  /// `unit` comes next in the reduction order and is about to flatten its
  /// gradient: if adding it will issue a collective, the reduction in flight is
  /// completed now, before the new flat gradient exists.
  void make_room(const Unit& unit);
  /// `unit` has flattened its gradient (Unit::flatten_grads): it joins the open
  /// bucket, which may be issued.
  void add(Unit* unit);
  /// Delivers, oldest first, each reduction whose collectives have already completed,
  /// without blocking; stops at the first still in flight, so deliveries keep their order.
  void deliver_landed();
  /// End of backward: issues the open bucket and completes every reduction, so
  /// that every member holds its reduced shard.
  void finish();
  /// Bucket buffers alive now (members' own flat gradients are the units').
  int64_t transient_bytes() const;
  /// Called with each member right after it adopts its reduced shard, oldest reduction
  /// first: the runtime's one arrival point for a reduced shard (Runtime::on_shard_reduced).
  void set_on_delivered(std::function<void(Unit&)> fn) { on_delivered_ = std::move(fn); }

 private:
  struct Reduction;
  static engine::BucketCandidate candidate(const Unit& unit);
  void issue_open_bucket();
  std::unique_ptr<Reduction> issue(std::vector<Unit*> members);
  void complete(Reduction& r);              // by phase: its window completes it
  void complete_scatter(Reduction& r);      // SCATTERING -> REPLICATING or DONE
  void hand_to_chain(Reduction& r);         // HYBRID_SHARD: the chain completes its scatter
  void complete_chained_scatter(Reduction& r);  // SCATTERING -> REPLICATING, from the chain
  void complete_replication(Reduction& r);  // REPLICATING -> DONE
  void deliver(Reduction& r);               // members adopt their shards
  // [Note: stream order wiring]: each returns at once when the stream order is off.
  StreamOrder* streams() const { return streams_ && streams_->enabled() ? streams_ : nullptr; }
  void order_issue(Reduction& r);           // the reduction stream takes the ready gradient
  void order_issued(Reduction& r);          // ... and writes the output
  void order_reduced(Reduction& r);         // compute waits for the reduction, frees the input

  comm::ProcessGroup reduce_pg_, replica_pg_;
  Tracer* tracer_;
  memory::BufferPool* pool_;
  engine::BucketFormer former_;
  std::vector<Unit*> open_;      // the open bucket, in reduction order
  engine::ReductionWindow scattering_;   // at most max_scattering
  engine::ReductionWindow replicating_;  // HYBRID_SHARD, unbounded
  std::unique_ptr<ReplicaChain> chain_;  // HYBRID_SHARD with a replica group of > 1 ranks
  std::function<void(Unit&)> on_delivered_;
  StreamOrder* streams_;
};

}  // namespace fsdp::core::detail
