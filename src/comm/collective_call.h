#pragma once
// Internal to the library: the one function every collective goes through.
//
// [Note: the collective choke point]
// The public collectives of collectives.h (and through them the object collectives, FSDP,
// ZeRO, the state layer and the Trainer) check their arguments, describe the call as a
// CollectiveCall and hand it to issue(). issue() is the only caller of a group's transport
// for collectives: it knows the group, the op, the dtype, the element count and the
// caller's label, counts the bytes the algorithm moves, shows the call to the observers,
// records it in the group's flight recorder (flight_recorder.h: a failure's error then names
// where the ranks first disagree), and hands it to the transport (or completes it locally
// on a group of one rank). What
// must see every collective (a device-specific transport choice, a record of recent calls
// for diagnosing hangs, cross-rank checks of what each rank issues) belongs here, not at
// the call sites. One exchange stays outside: the barrier that completes a sub-group's
// creation (process_group.cpp), which runs before the group has a transport.
#include <cstdint>
#include <functional>

#include <ATen/core/Tensor.h>

#include "fsdp/comm/call_label.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"

namespace fsdp::comm::detail {

enum class CollectiveOp { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier };
/// "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier".
const char* to_string(CollectiveOp op);

/// One collective as issued: already checked by its public entry point.
struct CollectiveCall {
  CollectiveOp op = CollectiveOp::kBarrier;
  /// all_gather: the flat buffer filled; reduce_scatter: this rank's output chunk;
  /// all_reduce and broadcast: the tensor, in place; barrier: undefined.
  at::Tensor out;
  /// all_gather: this rank's shard; reduce_scatter: the flat buffer; otherwise undefined.
  at::Tensor in;
  ReduceOp reduce = ReduceOp::kSum;  ///< reduce_scatter and all_reduce
  int root = 0;                     ///< broadcast
  CallLabel label;                  ///< the caller's, else its thread's LabelScope

  /// The dtype and element count of the buffer the op is about: the flat buffer for
  /// all-gather and reduce-scatter, the tensor otherwise (0 for a barrier).
  at::ScalarType dtype() const;
  int64_t numel() const;
};

/// Issues `call` on `g`: counts, observes, then the transport. The one caller of
/// Transport's collectives.
CommHandle issue(const ProcessGroup& g, CollectiveCall call);

/// Sees every collective this process issues, on the issuing thread, before the transport
/// does. For tests and diagnostics: must be cheap and must not issue collectives.
using CollectiveObserver = std::function<void(const ProcessGroup&, const CollectiveCall&)>;
/// Returns an id for remove_collective_observer.
int add_collective_observer(CollectiveObserver observer);
void remove_collective_observer(int id);

}  // namespace fsdp::comm::detail
