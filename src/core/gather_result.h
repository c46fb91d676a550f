#pragma once
// One unit's all-gather in flight, as FSDP2's AllGatherResult: the collective's handle, the
// (possibly cast) shard it sends, its trace span, and the stream order around it ([Note:
// stream order wiring] in runtime.h), so that Unit only says when to gather and when to wait.
#include <string>

#include <ATen/ATen.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/core/trace.h"
#include "stream_order.h"

namespace fsdp::core::detail {

class FlatParameter;

class GatherResult {
 public:
  /// Issues the all-gather of `flat`'s shard (cast to the compute dtype first: [Note: mixed
  /// precision] in flat_param.h) into its unsharded buffer, allocated by the caller, over
  /// `group` (or refreshes the mapped flat: [Note: zero-copy gathers]). streams: null when
  /// the stream order is off.
  static GatherResult issue(FlatParameter& flat, const comm::ProcessGroup& group, comm::CallLabel label,
                            StreamOrder* streams, Tracer* tracer);

  /// Waits for the all-gather; compute may then read the unsharded buffer and the cast
  /// source goes. Call once.
  void wait();

 private:
  GatherResult(FlatParameter& flat, std::string label, StreamOrder* streams, Tracer* tracer);
  void order_issue();   // the all-gather is about to be issued
  void order_issued();  // ... and was
  void order_waited();  // its handle completed
  bool cast() const;    // the source is a fresh low-precision copy, not the shard

  FlatParameter* flat_;
  std::string label_;
  StreamOrder* streams_;
  Tracer* tracer_;
  comm::CommHandle handle_;
  at::Tensor source_;  // lives until the gather completed
  Tracer::Mark mark_;
};

}  // namespace fsdp::core::detail
