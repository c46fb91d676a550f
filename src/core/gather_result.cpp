#include "gather_result.h"

#include <utility>

#include "flat_param.h"
#include "phase_span.h"

namespace fsdp::core::detail {

GatherResult::GatherResult(FlatParameter& flat, std::string label, StreamOrder* streams, Tracer* tracer)
    : flat_(&flat), label_(std::move(label)), streams_(streams), tracer_(tracer) {}

GatherResult GatherResult::issue(FlatParameter& flat, const comm::ProcessGroup& group, comm::CallLabel label,
                                 StreamOrder* streams, Tracer* tracer) {
  GatherResult g(flat, label.subject, streams, tracer);
  // Cast before the gather: param_dtype bytes move ([Note: mixed precision]). The cast copy
  // lives until the gather completes (wait).
  g.source_ = flat.shard_for_gather();
  g.order_issue();
  g.mark_ = tracer->begin(Tracer::kGather);
  {
    const auto on_stream = streams ? streams->make_current(StreamKind::kAllGather) : nullptr;
    {
      PhaseSpan issuing(tracer, "issue_gather", g.label_);
      // Mapped: the peers' shards are already in place ([Note: zero-copy gathers]).
      g.handle_ = flat.mapped() ? flat.mapped_flat().refresh(std::move(label))
                                : comm::all_gather_into(group, flat.unsharded(), g.source_, std::move(label));
    }
    g.handle_.order_current_stream();
  }
  tracer->end_on_device(g.mark_);
  g.order_issued();
  return g;
}

void GatherResult::wait() {
  {
    PhaseSpan waiting(tracer_, "wait_gather", label_);
    const auto elsewhere =
        streams_ && streams_->gather_handle_wait_off_compute() ? streams_->make_current(StreamKind::kCopy) : nullptr;
    handle_.wait();
  }
  tracer_->end("all_gather " + label_, Tracer::kGather, mark_, comm::to_string(handle_.path()));
  order_waited();  // before the handle and its source go
}

bool GatherResult::cast() const { return !source_.is_same(flat_->shard()); }

// ---- stream order ([Note: stream order wiring] in runtime.h) ----

void GatherResult::order_issue() {
  StreamOrder* so = streams_;
  if (!so) return;
  // A low-precision source is a fresh cast compute wrote; otherwise it is the shard.
  if (cast()) {
    so->acquire(StreamKind::kCompute, source_, "all-gather source (cast shard)", label_, /*fresh=*/true);
    so->write(StreamKind::kCompute, source_);
  }
  // Everything compute issued so far comes first: the last reads of the pool block the
  // gather overwrites, the optimizer's writes to the shard, the cast.
  so->wait(WaitSite::kGatherWaitsCompute, StreamKind::kAllGather,
           so->record(StreamKind::kCompute, "the issue of the all-gather of unit '" + label_ + "'"));
  so->acquire(StreamKind::kAllGather, flat_->unsharded(), "unsharded flat parameter", label_);
  if (cast()) so->read(StreamKind::kAllGather, source_);
}

void GatherResult::order_issued() {
  if (streams_) streams_->write(StreamKind::kAllGather, flat_->unsharded());
}

void GatherResult::order_waited() {
  if (!streams_) return;
  streams_->wait_written(WaitSite::kComputeWaitsGather, StreamKind::kCompute, flat_->unsharded());
  if (cast()) streams_->release(StreamKind::kCompute, source_);
}

}  // namespace fsdp::core::detail
