#include "grad_reducer.h"

#include "phase_span.h"
#include "unit.h"

namespace fsdp::core::detail {

namespace {
int64_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; }
}  // namespace

// One issued bucket ([Note: reduce buckets]), in the scattering window, then (HYBRID_SHARD)
// the replicating one.
struct GradReducer::Reduction : engine::ReductionWindow::Reduction {
  explicit Reduction(GradReducer& owner) : owner(owner) {}
  bool landed() const override {
    // A chained reduce-scatter counts once the chain issued its replica all-reduce.
    if (phase == Phase::kScattering && link) return owner.chain_->is_scattered(*link);
    return handle.is_completed();
  }
  void complete() override { owner.complete(*this); }
  int64_t held_bytes() const override { return nbytes(input); }

  enum class Phase { kScattering, kReplicating, kDone };
  GradReducer& owner;
  Phase phase = Phase::kScattering;
  std::vector<Unit*> members;
  std::vector<int64_t> offsets;  // member i's shard: output[offsets[i], offsets[i] + chunk_i)
  at::Tensor input;              // [rows, sum of chunks], flattened; freed once reduced
  at::Tensor output;             // the concatenated shards (the input itself when unsharded)
  comm::CommHandle handle;
  std::shared_ptr<ReplicaChain::Link> link;  // HYBRID_SHARD: the chain holds the scatter
  std::string label;             // "<unit>" or "<unit>+<unit>+..." for the trace
  Tracer::Mark mark;
};

GradReducer::GradReducer(comm::ProcessGroup reduce_group, comm::ProcessGroup replica_group,
                         int64_t cap_bytes, Tracer* tracer, memory::BufferPool* pool, int max_scattering,
                         StreamOrder* streams)
    : reduce_pg_(std::move(reduce_group)), replica_pg_(std::move(replica_group)), tracer_(tracer), pool_(pool),
      former_(cap_bytes),
      scattering_(max_scattering,
                  [this](std::unique_ptr<engine::ReductionWindow::Reduction> r) {
                    // Its replica all-reduce is in flight: it waits in the second window.
                    if (static_cast<Reduction&>(*r).phase == Reduction::Phase::kReplicating)
                      replicating_.push(std::move(r));
                  }),
      replicating_(/*max_in_flight=*/0), streams_(streams) {
  TORCH_INTERNAL_ASSERT(max_scattering >= 1);
  if (replica_pg_.defined() && replica_pg_.size() > 1)
    chain_ = std::make_unique<ReplicaChain>(replica_pg_, tracer_,
                                            streams_ ? streams_->current_maker(StreamKind::kReduceScatter) : nullptr);
}

GradReducer::~GradReducer() = default;

// What a unit's flat gradient will be (known before it is flattened).
engine::BucketCandidate GradReducer::candidate(const Unit& unit) {
  const FlatParameter& f = unit.flat();
  return engine::BucketCandidate{f.padded_numel() * int64_t(c10::elementSize(f.reduce_dtype())), f.sharded(),
                         f.reduce_dtype(), f.options().device()};
}

void GradReducer::make_room(const Unit& unit) {
  // Adding `unit` will issue a collective: complete the one in flight before the
  // unit's flat gradient is allocated, so that the two never coexist with the
  // unit's autograd gradients (the peak of unbucketed reduction stays as it was).
  if (former_.issues_on_join(candidate(unit))) scattering_.make_room();
}

void GradReducer::add(Unit* unit) {
  const engine::BucketCandidate c = candidate(*unit);
  TORCH_INTERNAL_ASSERT(unit->flat_grad().defined() && nbytes(unit->flat_grad()) == c.bytes, "unit '",
                        unit->label(), "' has no flat gradient of the expected size to reduce");
  const engine::BucketFormer::Join j = former_.join(c);
  if (j.close_before) issue_open_bucket();
  open_.push_back(unit);
  if (j.close_after) issue_open_bucket();
}

void GradReducer::complete(Reduction& r) {
  if (r.phase == Reduction::Phase::kScattering) complete_scatter(r);
  else complete_replication(r);
}

void GradReducer::issue_open_bucket() {
  if (open_.empty()) return;
  std::vector<Unit*> members = std::move(open_);
  open_.clear();
  scattering_.make_room();
  std::unique_ptr<Reduction> r = issue(std::move(members));
  if (chain_) hand_to_chain(*r);
  scattering_.push(std::move(r));
}

void GradReducer::hand_to_chain(Reduction& r) {
  // [Note: replica chain]: the chain's thread waits for the reduce-scatter and issues
  // the replica all-reduce the moment it completes, while backward goes on.
  r.link = chain_->push(std::move(r.handle), r.output, r.label, r.mark);
  r.handle = comm::CommHandle();
  r.mark = Tracer::Mark();  // the chain closes the reduce-scatter's span
}

std::unique_ptr<GradReducer::Reduction> GradReducer::issue(std::vector<Unit*> members) {
  auto r = std::make_unique<Reduction>(*this);
  const Unit& first = *members.front();
  const bool sharded = first.flat().sharded();
  const int64_t rows = sharded ? reduce_pg_.size() : 1;
  int64_t total = 0;
  for (Unit* u : members) {
    r->offsets.push_back(total);
    const int64_t numel = u->flat_grad().numel();
    TORCH_INTERNAL_ASSERT(numel % rows == 0, "flat gradient of unit '", u->label(), "' has ", numel,
                          " elements, not a multiple of ", rows, " ranks");
    total += numel / rows;
    r->label += (r->label.empty() ? "" : "+") + u->label();
  }
  if (members.size() == 1) {
    r->input = members.front()->take_flat_grad();  // no copy: the unbucketed reduction
  } else {
    r->input = pool_->empty(rows * total, first.flat_grad().options());
    if (auto* so = streams()) so->acquire(StreamKind::kCompute, r->input, "bucket input", r->label);
    auto table = r->input.view({rows, total});
    for (size_t i = 0; i < members.size(); ++i) {
      at::Tensor g = members[i]->take_flat_grad();
      const int64_t chunk = g.numel() / rows;
      table.narrow(1, r->offsets[i], chunk).copy_(g.view({rows, chunk}));
      if (auto* so = streams()) so->release(StreamKind::kCompute, g);
    }  // each member's flat gradient is freed here, after its copy
    if (auto* so = streams()) so->write(StreamKind::kCompute, r->input);
  }
  r->members = std::move(members);
  // Not pooled when sharded: the output becomes the gradient pieces, which outlive the step.
  r->output = sharded ? at::empty({total}, r->input.options()) : r->input;
  order_issue(*r);
  r->mark = tracer_->begin(Tracer::kReduce);  // after the stream's wait: the device span is the reduction's
  {
    const auto on_stream = streams() ? streams()->make_current(StreamKind::kReduceScatter) : nullptr;
    PhaseSpan issuing(tracer_, "issue_reduce", r->label);
    if (sharded) {
      r->handle = comm::reduce_scatter(reduce_pg_, r->output, r->input, comm::ReduceOp::kSum,
                                        {comm::Phase::kBackward, r->label});
    } else {
      r->handle = comm::all_reduce(reduce_pg_, r->input, comm::ReduceOp::kSum, {comm::Phase::kBackward, r->label});
    }
    r->handle.order_current_stream();
  }
  tracer_->end_on_device(r->mark);
  order_issued(*r);
  return r;
}

void GradReducer::complete_scatter(Reduction& r) {
  TORCH_INTERNAL_ASSERT(r.phase == Reduction::Phase::kScattering);
  if (r.link) {
    complete_chained_scatter(r);
    return;
  }
  {
    PhaseSpan waiting(tracer_, "wait_reduce", r.label);
    r.handle.wait();
  }
  tracer_->end("reduce " + r.label, Tracer::kReduce, r.mark, comm::to_string(r.handle.path()));
  deliver(r);  // frees the flat gradients (the input), then the handle that held them
}

void GradReducer::complete_chained_scatter(Reduction& r) {
  // The reduce-scatter is complete once the chain has issued the replica all-reduce
  // ([Note: hybrid groups]: summing the shard group's sums over the replica group
  // completes the sum over the world); usually that happened while backward ran.
  comm::CommPath scatter_path = comm::CommPath::kLocal;
  r.handle = chain_->scattered(*r.link, &r.mark, &scatter_path);
  r.link.reset();
  order_reduced(r);  // the flat gradients (the input) are freed once reduced
  r.phase = Reduction::Phase::kReplicating;
}

void GradReducer::complete_replication(Reduction& r) {
  TORCH_INTERNAL_ASSERT(r.phase == Reduction::Phase::kReplicating);
  {
    PhaseSpan waiting(tracer_, "wait_reduce", r.label);
    r.handle.wait();
  }
  tracer_->end("replica_all_reduce " + r.label, Tracer::kReduce, r.mark, comm::to_string(r.handle.path()));
  r.handle = comm::CommHandle();
  deliver(r);
}

void GradReducer::deliver(Reduction& r) {
  order_reduced(r);
  r.handle = comm::CommHandle();  // the collective's Work goes once its input is released
  if (auto* so = streams()) so->read(StreamKind::kCompute, r.output);  // adopt_reduced_shard reads it
  for (size_t i = 0; i < r.members.size(); ++i) {
    const int64_t chunk = r.members[i]->flat().sharded() ? r.members[i]->flat().chunk_numel()
                                                         : r.members[i]->flat().padded_numel();
    r.members[i]->adopt_reduced_shard(r.output.narrow(0, r.offsets[i], chunk));
  }
  r.output = r.input = at::Tensor();  // members keep what they use (views or casts)
  r.phase = Reduction::Phase::kDone;
  if (on_delivered_)
    for (Unit* u : r.members) on_delivered_(*u);
}

void GradReducer::deliver_landed() {
  // Completed collectives only: every wait below returns at once. The replica all-reduces
  // are older than every reduce-scatter still in flight.
  for (;;) {
    if (!replicating_.empty()) {
      if (!replicating_.oldest_landed()) return;
      replicating_.complete_oldest();
      continue;
    }
    if (!scattering_.oldest_landed()) return;
    scattering_.complete_oldest();
  }
}

// ---- stream order ([Note: stream order wiring] in runtime.h) ----

void GradReducer::order_issue(Reduction& r) {
  StreamOrder* so = streams();
  if (!so) return;
  // The gradient is ready on compute (its flattening, or the bucket's copy, wrote it last).
  so->wait_written(WaitSite::kReduceWaitsCompute, StreamKind::kReduceScatter, r.input);
  so->read(StreamKind::kReduceScatter, r.input);
  if (!r.output.is_same(r.input))
    so->acquire(StreamKind::kReduceScatter, r.output, "reduced shard", r.label, /*fresh=*/true);
}

void GradReducer::order_issued(Reduction& r) {
  StreamOrder* so = streams();
  if (!so) return;
  so->write(StreamKind::kReduceScatter, r.output);
  // HYBRID_SHARD: the chain's replica all-reduce rewrites the output on the same stream.
  if (chain_) so->write(StreamKind::kReduceScatter, r.output);
}

void GradReducer::order_reduced(Reduction& r) {
  // The arrival point of the reduced shards: compute waits for the reduction before it
  // frees the input or anything reads the output (adopt_reduced_shard, then
  // Runtime::on_shard_reduced).
  // Under HYBRID_SHARD the input goes when the scatter is done and the output arrives
  // after the replica all-reduce: compute waits at both.
  const bool frees_input = r.input.defined() && !r.output.is_same(r.input);
  if (StreamOrder* so = streams()) {
    so->wait_written(WaitSite::kComputeWaitsReduce, StreamKind::kCompute, r.output);
    if (frees_input) so->release(StreamKind::kCompute, r.input);
  }
  if (frees_input) r.input = at::Tensor();
}

void GradReducer::finish() {
  former_.clear();
  issue_open_bucket();
  // Oldest first (every replicating reduction is older than every scattering one):
  // collectives complete in the order issued. Meanwhile the chain's thread issues the
  // replica all-reduces of the reductions still scattering as they complete.
  while (!replicating_.empty() || !scattering_.empty()) {
    if (replicating_.empty()) scattering_.complete_oldest();
    else replicating_.complete_oldest();
  }
}

int64_t GradReducer::transient_bytes() const {
  // Flat-sized inputs only, as a unit counts its own flat gradient; the
  // shard-sized outputs become the gradient pieces.
  return scattering_.held_bytes() + replicating_.held_bytes();
}

}  // namespace fsdp::core::detail
