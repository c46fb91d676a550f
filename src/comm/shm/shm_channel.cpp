// [Note: shared-memory transport]
// Ranks on one host exchange all-gather, reduce-scatter and all-reduce data through POSIX
// shared memory instead of Gloo's loopback TCP, which costs about 1 ms of CPU per MB per
// direction on the machines this was measured on (kernel copies on both sides, Gloo's
// loop thread); a memcpy through shared memory costs a tenth of that. NCCL does the same
// inside a node.
//
// Set-up (make_shm_channel in shm_handshake.cpp, collective over the group, when the group
// is created and its transport chosen, transport_factory.cpp): every member creates one
// segment, publishes its name, a random nonce and its host identity (hostname and kernel
// boot id) under "fsdp/shm/<group>/" in the job's store, maps every peer's segment and
// checks the nonce, which proves the mapping is the peer's and not a namesake in another
// IPC namespace. Only when every member succeeded does the group use the channel (every
// member reads every member's verdict, so all agree); otherwise it stays on Gloo. Each
// member then unlinks its own segment name (every peer has it mapped by then), so a crash
// later leaves nothing in /dev/shm.
//
// A segment (shm_segment.h) is a header (pid, nonce, doorbell, failure flag) and a ring of
// `nslots` slots of `slot_bytes` each. Each rank is the only writer of its own ring and a
// reader of its peers'. A rank's ring carries one stream of *fragments* (at most one slot
// of bytes each, numbered from 1 in the order written): fragment i goes to slot
// (i-1) % nslots. Writing
// fragment i waits until every reader has released fragment i-nslots (readers_left == 0),
// copies the bytes, sets readers_left to the number of readers and publishes seq = i
// (release). A reader waits until seq == i (acquire), uses the bytes in place and
// decrements readers_left. Fragment numbers are never sent: every member issues the same
// operations in the same order, so it knows how many fragments each writer's stream holds
// before the current operation, and where each fragment of it goes (shm_ring_layout.h,
// computed the same way by the writer and its readers).
//   all-gather:     writer w's fragments are its shard, cut into slots, read by all peers,
//                   copied straight into chunk w of each peer's flat buffer; the writer
//                   copies each fragment from the slot it just wrote into its own chunk.
//   reduce-scatter: writer w's fragments are chunk p of its flat buffer for each peer p,
//                   segment by segment (segment j for every peer before segment j+1, so
//                   all readers progress together); reader r sums segment j of every row
//                   straight from the slots, its own row in place, in rank order: the
//                   same additions in the same order as the Gloo path, so the same bits.
//   all-reduce:     a reduce-scatter of near-equal chunks (sums into a slot-sized
//                   temporary, since the output is this rank's own row), then an
//                   all-gather of the reduced chunks, as two stages of one operation:
//                   the second stage starts once the first is complete on this rank.
// Bytes cross memory twice (into the ring, out of it), against four kernel copies and
// two TCP stacks over loopback.
//
// In place ([Note: exchange arena] in shm_arena.cpp): when what a fragment's readers take
// already lies in the writer's exchange arena (FSDP allocates its flat buffers there), the
// writer publishes the fragment's offset in the slot header (src_off) instead of copying it
// into the slot; for an all-gather it first copies its shard into its own chunk of the
// output, which is what the readers take. Readers copy or sum from the arena as they
// would from the slot, so the bytes cross memory once. The slot still orders the stream
// (same fragment numbers, same layout), but the fragment now lives in the writer's buffer,
// so the writer's stage completes only when every reader has released its in-place
// fragments: the writer cannot free or overwrite the buffer before its peers have read it. Each
// writer decides per fragment; readers follow what the slot says, so a channel mixes both.
//
// Progress (shm_progress.cpp): there is no thread. Issuing an operation writes what fits in
// the ring and reads what is already there; wait() moves everything the rest of the way.
// An operation larger than the ring therefore needs its peers to be waiting (or issuing)
// to finish, which is where a rank is when it needs the result. Any wait moves the pending
// operations of *every* channel of the world, in issue order (as one progress thread
// would), and so do waits on Gloo work while shared-memory operations are pending
// (gloo_transport.cpp): a rank blocked anywhere in fsdp::comm keeps feeding its peers, so
// two ranks waiting on different groups cannot starve each other. The channels of a world
// share one engine (shm_engine.h) whose lock serialises all of this; collectives are
// issued from one thread anyway.
//
// Waiting: spin briefly (a peer one slot behind finishes within microseconds), then sleep
// on a futex in this rank's segment header (the doorbell), which a peer bumps and wakes
// (only if someone sleeps) after publishing a fragment for us or releasing one of ours.
// Every 100 ms of waiting, and at the deadline (the group's timeout), the waiter checks its
// peers: a peer whose pid is gone, or which has raised its failure flag, fails the wait
// at once with a message naming it; so does the timeout, naming the peers whose data has
// not come. A rank that fails a wait raises its own flag, so its peers fail fast too
// instead of waiting for their timeouts.
//
// This file builds an operation's plan and issues it; the rest lives beside it: the segment
// (shm_segment.h), the set-up handshake (shm_handshake.cpp), the plan's arithmetic
// (shm_ring_layout.h) and moving and waiting (shm_progress.cpp).
#include "shm_channel.h"

#include <atomic>
#include <mutex>

#include "comm/tensor_bytes.h"
#include "shm_arena.h"
#include "shm_counters.h"
#include "shm_engine.h"
#include "shm_op.h"
#include "shm_segment.h"

namespace fsdp::comm {

CommCounters& shm_slot_counters() {
  static CommCounters counters;
  return counters;
}

CommCounters& shm_in_place_counters() {
  static CommCounters counters;
  return counters;
}

}  // namespace fsdp::comm

namespace fsdp::comm::detail {

namespace {

// The counter of an operation of `kind` in `c`.
std::atomic<int64_t>* shm_counter_of(CommCounters& c, uint32_t kind) {
  switch (kind) {
    case kShmAllGather: return &c.all_gather;
    case kShmReduceScatter: return &c.reduce_scatter;
    default: return &c.all_reduce;
  }
}

// `n` chunks of `c` bytes, chunk p at p * c.
shm_plan::Geometry equal_chunks(int n, int64_t c) {
  shm_plan::Geometry geo;
  for (int p = 0; p < n; ++p) {
    geo.off.push_back(p * c);
    geo.len.push_back(c);
  }
  return geo;
}

// Near-equal chunks of whole elements: chunk p holds elements [numel*p/n, numel*(p+1)/n).
shm_plan::Geometry near_equal_chunks(int n, int64_t numel, int64_t item) {
  shm_plan::Geometry geo;
  for (int p = 0; p < n; ++p) {
    const int64_t b = numel * p / n, e = numel * (p + 1) / n;
    geo.off.push_back(b * item);
    geo.len.push_back((e - b) * item);
  }
  return geo;
}

}  // namespace

ShmChannel::~ShmChannel() {
  if (!engine_) return;  // set-up failed before registering
  std::lock_guard<std::mutex> lock(engine_->mutex());
  engine_->remove_locked(this);
}

std::shared_ptr<ShmOp> ShmChannel::new_op(const char* name, uint32_t kind, int64_t bytes, at::ScalarType dtype,
                                          ReduceOp reduce, std::vector<at::Tensor> keep) {
  auto op = std::make_shared<ShmOp>();
  op->name = name;
  op->kind = kind;
  op->bytes = bytes;
  op->written = shm_counter_of(shm_slot_counters(), kind);
  op->in_place = shm_counter_of(shm_in_place_counters(), kind);
  op->dtype = dtype;
  op->reduce = reduce;
  op->keep = std::move(keep);
  return op;
}

shm_plan::StageSpec ShmChannel::stage_spec(bool gather, shm_plan::Geometry geo) const {
  shm_plan::StageSpec spec;
  spec.gather = gather;
  spec.me = rank_;
  spec.n = size_;
  spec.geo = std::move(geo);
  spec.slot = slot_bytes_;
  if (own_arena_) spec.arena = {own_arena_->base(), own_arena_->bytes()};
  return spec;
}

std::shared_ptr<ShmOp> ShmChannel::all_gather(const at::Tensor& flat, const at::Tensor& shard) {
  auto op = new_op("all_gather", kShmAllGather, nbytes(flat), flat.scalar_type(), ReduceOp::kSum, {flat, shard});
  shm_plan::StageSpec spec = stage_spec(true, equal_chunks(size_, nbytes(shard)));
  spec.src = static_cast<const char*>(shard.data_ptr());
  spec.dst = static_cast<char*>(flat.data_ptr());
  op->stages.emplace_back();
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());  // assigned_ is shared with progress
    shm_plan::build_stage(op->stages.back(), spec, assigned_);
  }
  return issue(std::move(op));
}

std::shared_ptr<ShmOp> ShmChannel::reduce_scatter(const at::Tensor& out, const at::Tensor& flat, ReduceOp rop) {
  auto op = new_op("reduce_scatter", kShmReduceScatter, nbytes(flat), flat.scalar_type(), rop, {out, flat});
  shm_plan::StageSpec spec = stage_spec(false, equal_chunks(size_, nbytes(out)));
  spec.src = static_cast<const char*>(flat.data_ptr());
  spec.dst = static_cast<char*>(out.data_ptr());
  op->stages.emplace_back();
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    shm_plan::build_stage(op->stages.back(), spec, assigned_);
  }
  return issue(std::move(op));
}

std::shared_ptr<ShmOp> ShmChannel::all_reduce(const at::Tensor& t, ReduceOp rop) {
  auto op = new_op("all_reduce", kShmAllReduce, nbytes(t), t.scalar_type(), rop, {t});
  const shm_plan::Geometry geo = near_equal_chunks(size_, t.numel(), static_cast<int64_t>(t.element_size()));
  char* base = static_cast<char*>(t.data_ptr());
  // Stage 1 reduces into our own chunk of t, which is also our row: via the temporary.
  // In place, stage 1 lets the peers read our rows of t while we write our own chunk
  // (which no peer reads in stage 1); stage 2 overwrites row p only with what peer p
  // published after its stage 1, i.e. after it read our row p.
  shm_plan::StageSpec reduce = stage_spec(false, geo);
  reduce.src = base;
  reduce.dst = base + geo.off[rank_];
  reduce.via_temp = true;
  // Stage 2 gathers the reduced chunks back into t.
  shm_plan::StageSpec gather = stage_spec(true, geo);
  gather.src = base + geo.off[rank_];
  gather.dst = base;
  op->stages.resize(2);
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    shm_plan::build_stage(op->stages[0], reduce, assigned_);
    shm_plan::build_stage(op->stages[1], gather, assigned_);
  }
  return issue(std::move(op));
}

std::shared_ptr<ShmOp> ShmChannel::issue(std::shared_ptr<ShmOp> op) {
  std::lock_guard<std::mutex> lock(engine_->mutex());
  op->number = ++ops_issued_;
  TORCH_CHECK(broken_.empty(), "fsdp: ", op->name, " on group '", group_name_, "' (rank ", rank_,
              "): the group's shared-memory transport failed earlier: ", broken_);
  for (const auto& st : op->stages) op->writes_total += st.writes.size();
  pending_.push_back(op);
  progress_locked();
  return op;
}

at::DataPtr ShmChannel::allocate_direct(size_t nbytes) {
  return own_arena_ ? own_arena_->allocate(nbytes) : at::DataPtr();
}

std::vector<std::shared_ptr<ShmArena>> ShmChannel::exchange_arenas() const {
  if (!own_arena_) return {};
  auto all = arenas_;
  all[static_cast<size_t>(rank_)] = own_arena_;
  return all;
}

}  // namespace fsdp::comm::detail
