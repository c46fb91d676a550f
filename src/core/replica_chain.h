#pragma once
// Internal to src/core: HYBRID_SHARD's second reduction stage, started by a thread of its
// own as soon as the first stage completes.
//
// [Note: replica chain]
// Under HYBRID_SHARD a bucket's gradient is reduce-scattered over the shard group (one
// host: shared memory), then its reduced shard is all-reduced over the replica group
// (across hosts: Gloo over TCP, the slow link). The all-reduce can only start once the
// reduce-scatter is complete, and the shared-memory transport has no thread: a
// reduce-scatter completes only when some thread of this process waits on it. Waiting
// on the backward thread is either late (GradReducer used to complete it when the next
// bucket was issued, which for a model whose first layer is also its largest unit put
// every large replica all-reduce after backward: nothing overlapped,
// docs/benchmarks.md "Quiet rerun at 1 Gbit/s") or a synchronisation point with the
// peer ranks of the host in the middle of backward (waiting right after issuing:
// slower in the run measured then).
//
// The chain is one thread per GradReducer that does exactly that wait, off the
// backward thread: the reducer hands it each issued reduce-scatter (push), in issue
// order; the thread waits for it, then issues the replica all-reduce of its output,
// then takes the next. So each replica all-reduce starts as soon as its reduce-scatter
// has completed on this rank, while backward goes on computing, and a second one may
// start while the first is still on the link (Gloo runs two at once; the link is the
// bottleneck either way, but it does not idle between them).
//
// What stays as it was:
//   - collective order: reduce-scatters are issued by the backward thread in the
//     reduction order; replica all-reduces by the chain thread in push order, which is
//     that same order. The replica group carries nothing else during backward (the
//     reducer's finish() has taken every all-reduce back before backward ends), so
//     every rank issues the same collectives in the same order on each group;
//   - results: the same collectives on the same tensors, so the same bits;
//   - who touches units: only the backward thread. The thread waits and issues; the
//     reducer takes each all-reduce back (scattered) and waits for it itself
//     (deliver: members adopt their shards), as before;
//   - memory: the reducer still waits (scattered) before the next bucket's flat
//     gradient exists, so flat gradients in flight stay bounded; the thread never
//     drops the last reference to a tensor (the reducer's Reduction holds them).
// Thread safety of what the thread calls: the shared-memory engine serialises every
// channel under its lock (shm_engine.h), so a wait here moves the backward thread's
// pending gathers too, like any wait; Gloo's process group queues work under its own
// lock; the tracer and the byte counters are thread-safe.
//
// Errors: a failed wait or issue is kept and rethrown by the reducer when it takes
// that bucket back; the thread then issues nothing more (a later all-reduce would be
// out of order with the peers), and every later bucket fails with the same error.
// Shutdown: the thread is detached and shares only the chain's state (queue, replica
// group, tracer pointer). The destructor tells it to stop and clears the tracer
// pointer: an idle thread exits at once; one still blocked in a wait (an exception
// left reductions in flight) exits when that wait returns or times out, without
// issuing anything more, so the destructor never blocks on a peer.
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/trace.h"

namespace fsdp::core::detail {

class ReplicaChain {
 public:
  /// One pushed reduction. Opaque to the reducer but for the calls below.
  struct Link;

  /// replica_group: of size > 1. tracer: where the thread records the end of each
  /// reduce-scatter span and the start of each replica all-reduce span. on_stream: made
  /// once by the thread and held while it runs, so that it waits and issues on the
  /// reduce-scatter stream ([Note: stream order wiring]); may be empty.
  ReplicaChain(comm::ProcessGroup replica_group, Tracer* tracer,
               std::function<std::shared_ptr<void>()> on_stream = {});
  ~ReplicaChain();
  ReplicaChain(const ReplicaChain&) = delete;
  ReplicaChain& operator=(const ReplicaChain&) = delete;

  /// Hands over an issued reduce-scatter (`scatter`, over the shard group, into `output`,
  /// begun at `mark`): the thread waits for it, closes span "reduce <label>" and issues
  /// the sum of `output` over the replica group in place.
  std::shared_ptr<Link> push(comm::CommHandle scatter, at::Tensor output, const std::string& label,
                             Tracer::Mark mark);
  /// Blocks until `link`'s reduce-scatter is complete and its replica all-reduce issued;
  /// returns that all-reduce (begun at *mark, for span "replica_all_reduce <label>") and
  /// the path its reduce-scatter took. Rethrows the thread's error. Once per link.
  comm::CommHandle scattered(Link& link, Tracer::Mark* mark, comm::CommPath* scatter_path);
  /// Whether scattered(link) would return at once, asked without blocking.
  bool is_scattered(const Link& link) const;

 private:
  struct State;
  static void run(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace fsdp::core::detail
