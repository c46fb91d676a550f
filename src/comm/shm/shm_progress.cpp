// Moving and waiting: the progress engine of one channel and its waits ([Note: shared-memory
// transport] in shm_channel.cpp, "Progress" and "Waiting").
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>

#include <ATen/ATen.h>

#include "comm/number_text.h"
#include "comm/process_gone.h"
#include "comm/row_sum.h"
#include "shm_arena.h"
#include "shm_channel.h"
#include "shm_engine.h"
#include "shm_op.h"
#include "shm_segment.h"

namespace fsdp::comm::detail {

using shm_plan::Read;
using shm_plan::Stage;
using shm_plan::Write;

namespace {

// dst = rows[0] op rows[1] op ... in rank order (then / n for Avg), `count` elements:
// the sum is the one every transport uses (row_sum.h), so the bits match the Gloo path.
void reduce_rows(at::ScalarType dtype, ReduceOp op, char* dst, const std::vector<const char*>& rows,
                 int64_t count) {
  auto view = [&](const char* p) {
    return at::from_blob(const_cast<char*>(p), {count}, at::TensorOptions().dtype(dtype));
  };
  auto out = view(dst);
  std::vector<at::Tensor> parts;
  parts.reserve(rows.size());
  for (const char* r : rows) parts.push_back(view(r));
  if (op == ReduceOp::kMax) {
    at::maximum_out(out, parts[0], parts[1]);
    for (size_t p = 2; p < parts.size(); ++p) at::maximum_out(out, out, parts[p]);
    return;
  }
  sum_rows_into(out, parts);
  if (op == ReduceOp::kAvg) out.div_(static_cast<int64_t>(parts.size()));
}

const char* kind_name(uint32_t kind) {
  switch (kind) {
    case kShmAllGather: return "all_gather";
    case kShmReduceScatter: return "reduce_scatter";
    case kShmAllReduce: return "all_reduce";
  }
  return "unknown operation";
}

// "" when the fragment behind `sh` belongs to `op` as this rank issued it ([Note: checked
// slots] in shm_op.h).
std::string slot_mismatch(const ShmOp& op, const std::string& writer, const SlotHeader& sh) {
  if (sh.op_number == op.number && sh.op_kind == op.kind && sh.op_bytes == op.bytes) return "";
  std::ostringstream os;
  os << writer << " sent data of its " << kind_name(sh.op_kind) << " #" << sh.op_number << " of "
     << with_thousands(sh.op_bytes) << " bytes where this rank is at " << kind_name(op.kind) << " #" << op.number
     << " of " << with_thousands(op.bytes) << " bytes: the ranks issued different collectives on this group";
  return os.str();
}

// How often a waiting rank looks at its peers' health and its deadline.
constexpr std::chrono::milliseconds kPeerCheckEvery{100};
// Rounds of progress without movement that a waiter spins through before it sleeps.
constexpr int kSpinRounds = 64;

}  // namespace

// ---------------------------------------------------------------------------------------
// Progress

bool ShmChannel::progress_locked() {
  bool moved = false;
  bool may_write = true;  // false once an earlier operation still has fragments to write
  for (size_t i = 0; i < pending_.size();) {
    ShmOp& op = *pending_[i];
    moved |= advance_locked(op, may_write);
    if (op.writes_done < op.writes_total) may_write = false;
    if (op.stage == op.stages.size()) {
      op.keep.clear();
      op.done = true;
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      moved = true;
    } else {
      ++i;
    }
  }
  return moved;
}

// Takes `op` through its stages as far as they go now; true if anything moved.
bool ShmChannel::advance_locked(ShmOp& op, bool may_write) {
  bool moved = false;
  while (op.stage < op.stages.size()) {
    Stage& st = op.stages[op.stage];
    if (may_write) moved |= write_fragments_locked(op, st);
    moved |= read_fragments_locked(op, st);
    moved |= release_in_place_locked(st);
    if (!st.complete()) break;
    ++op.stage;  // the next stage's writes may read what this one produced
  }
  return moved;
}

// Writes: strictly in stream order, each into a slot its readers have released.
bool ShmChannel::write_fragments_locked(ShmOp& op, Stage& st) {
  bool moved = false;
  while (st.next_write < st.writes.size()) {
    const Write& w = st.writes[st.next_write];
    TORCH_INTERNAL_ASSERT(w.fragment == published_ + 1, "fsdp: shared-memory stream out of order");
    if (segs_[rank_]->slot(slot_of(w.fragment))->readers_left.load(std::memory_order_acquire) != 0) break;
    publish_locked(op, st, w);
    ++st.next_write;
    ++op.writes_done;
    moved = true;
  }
  return moved;
}

// Fills the slot of fragment `w` (or points it at our arena), publishes it and rings its
// readers.
void ShmChannel::publish_locked(ShmOp& op, Stage& st, const Write& w) {
  ShmSegment& mine = *segs_[rank_];
  const int s = slot_of(w.fragment);
  SlotHeader* sh = mine.slot(s);
  if (w.arena_off >= 0) {
    if (w.own_dst) std::memcpy(w.own_dst, w.src, static_cast<size_t>(w.bytes));
    sh->src_off = w.arena_off;
    st.in_place.push_back(w.fragment);
    *op.in_place += w.bytes;
  } else {
    std::memcpy(mine.data(s), w.src, static_cast<size_t>(w.bytes));
    if (w.own_dst) std::memcpy(w.own_dst, mine.data(s), static_cast<size_t>(w.bytes));
    sh->src_off = -1;
  }
  *op.written += w.bytes;
  sh->op_number = op.number;
  sh->op_bytes = op.bytes;
  sh->op_kind = op.kind;
  sh->readers_left.store(w.reader < 0 ? size_ - 1 : 1, std::memory_order_relaxed);
  sh->seq.store(w.fragment, std::memory_order_release);
  published_ = w.fragment;
  if (w.reader >= 0) {
    ring_doorbell(segs_[w.reader]->hdr());
  } else {
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) ring_doorbell(segs_[p]->hdr());
    }
  }
}

// Reads: in order, each once all its fragments are there.
bool ShmChannel::read_fragments_locked(ShmOp& op, Stage& st) {
  bool moved = false;
  while (st.next_read < st.reads.size()) {
    const Read& r = st.reads[st.next_read];
    if (!fragments_ready_locked(op, r)) break;
    consume_locked(op, r);
    for (const auto& [w, fragment] : r.fragments) {
      auto* sh = segs_[w]->slot(slot_of(fragment));
      if (sh->readers_left.fetch_sub(1, std::memory_order_acq_rel) == 1) ring_doorbell(segs_[w]->hdr());
    }
    ++st.next_read;
    moved = true;
  }
  return moved;
}

// Whether every fragment `r` takes is published and belongs to `op`; the first that does
// not belong is kept in mismatch_ for the wait to report.
bool ShmChannel::fragments_ready_locked(const ShmOp& op, const Read& r) {
  for (const auto& [w, fragment] : r.fragments) {
    const auto* sh = segs_[w]->slot(slot_of(fragment));
    if (sh->seq.load(std::memory_order_acquire) != fragment) return false;
    if (mismatch_.empty()) mismatch_ = slot_mismatch(op, peer_names_[w], *sh);
    if (!mismatch_.empty()) return false;
  }
  return true;
}

// Copies, or reduces in rank order, what `r` takes into its destination.
void ShmChannel::consume_locked(const ShmOp& op, const Read& r) {
  if (r.kind == Read::Kind::kCopy) {
    const auto& [w, fragment] = r.fragments[0];
    std::memcpy(r.dst, fragment_data(w, fragment, r.bytes), static_cast<size_t>(r.bytes));
    return;
  }
  std::vector<const char*> rows(static_cast<size_t>(size_));
  rows[rank_] = r.own;
  for (const auto& [w, fragment] : r.fragments) rows[w] = fragment_data(w, fragment, r.bytes);
  const int64_t count = r.bytes / static_cast<int64_t>(c10::elementSize(op.dtype));
  char* out = r.via_temp ? temp_.get() : r.dst;
  reduce_rows(op.dtype, op.reduce, out, rows, count);
  if (r.via_temp) std::memcpy(r.dst, out, static_cast<size_t>(r.bytes));
}

// Where the `bytes` of writer w's fragment lie: in its slot, or in its exchange arena.
const char* ShmChannel::fragment_data(int w, uint64_t fragment, int64_t bytes) const {
  const int s = slot_of(fragment);
  const int64_t off = segs_[w]->slot(s)->src_off;
  if (off < 0) return segs_[w]->data(s);
  TORCH_INTERNAL_ASSERT(arenas_[w] && off + bytes <= arenas_[w]->bytes(),
                        "fsdp: a peer published a fragment outside its exchange arena");
  return arenas_[w]->base() + off;
}

// Releases of our in-place fragments, in order (a slot taken by a later fragment was
// released before it).
bool ShmChannel::release_in_place_locked(Stage& st) {
  bool moved = false;
  const ShmSegment& mine = *segs_[rank_];
  while (st.next_release < st.in_place.size()) {
    const uint64_t fragment = st.in_place[st.next_release];
    const SlotHeader* sh = mine.slot(slot_of(fragment));
    if (sh->seq.load(std::memory_order_acquire) == fragment &&
        sh->readers_left.load(std::memory_order_acquire) != 0)
      break;
    ++st.next_release;
    moved = true;
  }
  return moved;
}

// ---------------------------------------------------------------------------------------
// Waiting

void ShmChannel::wait(ShmOp& op) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto next_check = start + kPeerCheckEvery;
  int idle = 0;
  for (;;) {
    // Move what moves without waiting.
    bool moved = false;
    std::string mismatch;  // [Note: checked slots]
    if (progress_once(op, &moved, &mismatch)) return;
    if (!mismatch.empty()) fail(op, mismatch);
    if (moved) {
      idle = 0;
      continue;
    }
    // Spin a little: a peer one fragment behind publishes within microseconds.
    if (++idle < kSpinRounds) {
      for (int k = 0; k < 32; ++k) cpu_relax();
      continue;
    }
    // Sleep until a peer rings.
    bool done = false;
    moved = sleep_until_moved(op, &done);
    if (done) return;
    idle = moved ? 0 : idle;
    // Now and then: the peers' health, and the deadline.
    const auto now = clock::now();
    if (now >= next_check) {
      next_check = now + kPeerCheckEvery;
      check_peers_or_fail(op, now - start);
    }
  }
}

// One round of progress of every channel of the engine; true once `op` is done. Fails at
// once when this channel failed earlier.
bool ShmChannel::progress_once(const ShmOp& op, bool* moved, std::string* mismatch) {
  std::lock_guard<std::mutex> lock(engine_->mutex());
  if (op.done) return true;
  TORCH_CHECK(broken_.empty(), "fsdp: ", op.name, " on group '", group_name_, "' (rank ", rank_,
              "): the group's shared-memory transport failed earlier: ", broken_);
  *moved = engine_->progress_locked();
  if (op.done) return true;
  *mismatch = mismatch_;
  return false;
}

// Sleeps on this rank's doorbell unless a last round of progress moves something or
// completes `op` (`done`); true if something moved. Other channels with pending work ring
// other doorbells: it sleeps shorter then.
bool ShmChannel::sleep_until_moved(const ShmOp& op, bool* done) {
  ShmEngine& e = *engine_;
  SegHeader* h = segs_[rank_]->hdr();
  h->sleepers.fetch_add(1, std::memory_order_seq_cst);
  const uint32_t bell = h->doorbell.load(std::memory_order_seq_cst);
  bool moved = false;
  {
    std::lock_guard<std::mutex> lock(e.mutex());
    moved = e.progress_locked();
    *done = op.done;
  }
  if (!moved && !*done) {
    bool others = false;
    {
      std::lock_guard<std::mutex> lock(e.mutex());
      others = e.pending_locked(this);
    }
    sleep_on_doorbell(h, bell, std::chrono::microseconds(others ? 1000 : 50000));
  }
  h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return moved;
}

// Fails the wait when a peer is gone or gave up, or when it has lasted the group's timeout.
void ShmChannel::check_peers_or_fail(const ShmOp& op, std::chrono::steady_clock::duration waited) {
  const std::string problem = peer_problem();
  if (!problem.empty()) fail(op, problem);
  if (waited < timeout_) return;
  std::string blocked;
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    blocked = blocking_peers(op);
  }
  fail(op, "timed out after " + std::to_string(timeout_.count()) + " ms: " + blocked);
}

// Fails this wait, and tells the peers (they fail fast instead of timing out).
void ShmChannel::fail(const ShmOp& op, const std::string& cause) {
  const std::string msg = failure(op, cause);
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    if (broken_.empty()) broken_ = msg;
  }
  SegHeader* h = segs_[rank_]->hdr();
  if (h->failed.load(std::memory_order_relaxed) == 0) {
    std::snprintf(h->reason, sizeof(h->reason), "%s", cause.c_str());
    h->failed.store(1, std::memory_order_release);
  }
  TORCH_CHECK(false, msg);
}

std::string ShmChannel::peer_problem() const {
  // A peer that exited without giving up first (it crashed or was killed): the cause.
  // Failures of other peers may only be the echo of it.
  for (int p = 0; p < size_; ++p) {
    const SegHeader* h = segs_[p]->hdr();
    if (p != rank_ && h->failed.load(std::memory_order_acquire) == 0 &&
        process_gone(h->pid)) {
      return "gone: " + peer_names_[p] + " (exited while this rank waited on it)";
    }
  }
  // A peer that gave up (and may have exited since): its reason says what it saw.
  for (int p = 0; p < size_; ++p) {
    const SegHeader* h = segs_[p]->hdr();
    if (p != rank_ && h->failed.load(std::memory_order_acquire) != 0) {
      const std::string why(h->reason, strnlen(h->reason, sizeof(h->reason)));
      return peer_names_[p] + " gave up on the group after an error of its own (" + why + ")";
    }
  }
  return "";
}

std::string ShmChannel::blocking_peers(const ShmOp& op) const {
  if (op.stage >= op.stages.size()) return "";
  const Stage& st = op.stages[op.stage];
  std::vector<int> waiting;
  if (st.next_read < st.reads.size()) {
    for (const auto& [w, fragment] : st.reads[st.next_read].fragments) {
      const auto* sh = segs_[w]->slot(slot_of(fragment));
      if (sh->seq.load(std::memory_order_acquire) != fragment) waiting.push_back(w);
    }
  }
  std::ostringstream os;
  if (!waiting.empty()) {
    os << "no data from ";
    for (size_t i = 0; i < waiting.size(); ++i) os << (i ? ", " : "") << peer_names_[waiting[i]];
  } else {
    os << "peers did not take the data this rank wrote (its ring stayed full, or fragments it published in "
          "place were not released)";
  }
  return os.str();
}

std::string ShmChannel::failure(const ShmOp& op, const std::string& cause) const {
  std::ostringstream os;
  os << "fsdp: " << op.name << " on group '" << group_name_ << "' failed on rank " << rank_ << " of "
     << size_ << " (world rank " << global_rank_ << ", timeout " << timeout_.count()
     << " ms, shared-memory transport): " << cause
     << ". Another rank probably exited or stopped calling collectives; check its log";
  return os.str();
}

}  // namespace fsdp::comm::detail
