// [Note: shared-memory transport]
// Ranks on one host exchange all-gather, reduce-scatter and all-reduce data through POSIX
// shared memory instead of Gloo's loopback TCP, which costs about 1 ms of CPU per MB per
// direction on the machines this was measured on (kernel copies on both sides, Gloo's
// loop thread); a memcpy through shared memory costs a tenth of that. NCCL does the same
// inside a node.
//
// Set-up (make_shm_channel, collective over the group, when the group is created and its
// transport chosen, transport.cpp): every member creates one segment, publishes its name,
// a random nonce and its host identity (hostname and kernel boot id) under
// "fsdp/shm/<group>/" in the job's store, maps every peer's segment and checks the nonce,
// which proves the mapping is the peer's and not a namesake in another IPC namespace.
// Only when every member succeeded does the group use the channel (every member reads
// every member's verdict, so all agree); otherwise it stays on Gloo. Each member then unlinks its own segment name (every peer has it mapped
// by then), so a crash later leaves nothing in /dev/shm.
//
// A segment is a header (pid, nonce, doorbell, failure flag) and a ring of `nslots` slots
// of `slot_bytes` each. Each rank is the only writer of its own ring and a reader of its
// peers'. A rank's ring carries one stream of *pieces* (at most one slot of bytes each,
// numbered from 1 in the order written): piece i goes to slot (i-1) % nslots. Writing
// piece i waits until every reader has released piece i-nslots (readers_left == 0),
// copies the bytes, sets readers_left to the number of readers and publishes seq = i
// (release). A reader waits until seq == i (acquire), uses the bytes in place and
// decrements readers_left. Piece numbers are never sent: every member issues the same
// operations in the same order, so it knows how many pieces each writer's stream holds
// before the current operation, and where each piece of it goes (layout(), computed the
// same way by the writer and its readers).
//   all-gather:     writer w's pieces are its shard, cut into slots, read by all peers,
//                   copied straight into chunk w of each peer's flat buffer; the writer
//                   copies each piece from the slot it just wrote into its own chunk.
//   reduce-scatter: writer w's pieces are chunk p of its flat buffer for each peer p,
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
// In place ([Note: exchange arena] in shm_arena.cpp): when what a piece's readers take
// already lies in the writer's exchange arena (FSDP allocates its flat buffers there), the
// writer publishes the piece's offset in the slot header (src_off) instead of copying it
// into the slot; for an all-gather it first copies its shard into its own chunk of the
// output, which is what the readers take. Readers copy or sum from the arena as they
// would from the slot, so the bytes cross memory once. The slot still orders the stream
// (same piece numbers, same layout), but the piece now lives in the writer's buffer, so
// the writer's stage completes only when every reader has released its in-place pieces:
// the writer cannot free or overwrite the buffer before its peers have read it. Each
// writer decides per piece; readers follow what the slot says, so a channel mixes both.
//
// Progress: there is no thread. Issuing an operation writes what fits in the ring and
// reads what is already there; wait() moves everything the rest of the way. An operation
// larger than the ring therefore needs its peers to be waiting (or issuing) to finish,
// which is where a rank is when it needs the result. Any wait moves the pending
// operations of *every* channel of the world, in issue order (as one progress thread
// would), and so do waits on Gloo work while shared-memory operations are pending
// (gloo_transport.cpp): a rank blocked anywhere in fsdp::comm keeps feeding its peers, so
// two ranks waiting on different groups cannot starve each other. The channels of a world
// share one engine (shm_engine.h) whose lock serialises all of this; collectives are
// issued from one thread anyway.
//
// Waiting: spin briefly (a peer one slot behind finishes within microseconds), then sleep
// on a futex in this rank's segment header (the doorbell), which a peer bumps and wakes
// (only if someone sleeps) after publishing a piece for us or releasing one of ours. Every
// 100 ms of waiting, and at the deadline (the group's timeout), the waiter checks its
// peers: a peer whose pid is gone, or which has raised its failure flag, fails the wait
// at once with a message naming it; so does the timeout, naming the peers whose data has
// not come. A rank that fails a wait raises its own flag, so its peers fail fast too
// instead of waiting for their timeouts.
#include "shm_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/comm_testing.h"
#include "comm/divergence.h"
#include "comm/process_gone.h"
#include "comm/row_sum.h"
#include "comm/store_bytes.h"
#include "shm_arena.h"
#include "shm_engine.h"
#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

namespace {

constexpr uint64_t kMagic = 0x3174687370647366ull;  // "fsdpsht1"
constexpr int kMinSlots = 16;

struct alignas(64) SegHeader {
  uint64_t magic;
  uint64_t nonce;
  int64_t slot_bytes;
  int32_t nslots;
  int32_t pid;
  alignas(64) std::atomic<uint32_t> doorbell;  // bumped when something for this rank moved
  std::atomic<uint32_t> sleepers;              // threads of this rank in futex_wait
  alignas(64) std::atomic<uint32_t> failed;    // this rank gave up on the group...
  char reason[512];                            // ...for this reason (set before `failed`)
};

struct alignas(64) SlotHeader {
  std::atomic<uint64_t> seq;           // piece number held, 0 = none yet
  std::atomic<uint32_t> readers_left;  // readers that have not released it
  // -1: the piece's bytes are in the slot. Else they are at this offset of the writer's
  // exchange arena (written before seq is published, read after it is seen).
  int64_t src_off = -1;
  // Which operation of the writer's the piece belongs to ([Note: checked slots]); written
  // before seq is published, checked by every reader after it is seen.
  uint64_t op_number = 0;
  int64_t op_bytes = 0;
  uint32_t op_kind = 0;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free (address-free)");

int64_t data_offset(int nslots) {
  return round_up(int64_t(sizeof(SegHeader)) + nslots * int64_t(sizeof(SlotHeader)), 4096);
}

int64_t mapping_bytes(int nslots, int64_t slot_bytes) {
  return data_offset(nslots) + nslots * slot_bytes;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds t) {
  timespec ts{static_cast<time_t>(t.count() / 1000000), static_cast<long>(t.count() % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

std::string host_identity() {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '?';
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(host) + "/" + (boot.empty() ? "?" : boot);
}


}  // namespace

// One mapped segment: ours (created) or a peer's (opened).
struct ShmSegment {
  void* base;
  int64_t bytes;
  int nslots;
  int64_t slot_bytes;

  // Takes over a mapping of mapping_bytes(nslots, slot_bytes) at `base`.
  ShmSegment(void* base, int nslots, int64_t slot_bytes)
      : base(base), bytes(mapping_bytes(nslots, slot_bytes)), nslots(nslots), slot_bytes(slot_bytes) {}
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  SegHeader* hdr() const { return static_cast<SegHeader*>(base); }
  SlotHeader* slot(int i) const {
    return reinterpret_cast<SlotHeader*>(static_cast<char*>(base) + sizeof(SegHeader)) + i;
  }
  char* data(int i) const { return static_cast<char*>(base) + data_offset(nslots) + i * slot_bytes; }
  ~ShmSegment() {
    if (base) ::munmap(base, static_cast<size_t>(bytes));
  }
};

namespace {

// Creates, sizes (reserving the pages: a full /dev/shm fails here, not with SIGBUS on
// first touch) and maps our segment. On failure returns nullptr and says why.
std::unique_ptr<ShmSegment> create_segment(int nslots, int64_t slot_bytes, uint64_t nonce,
                                           std::string* name, std::string* why) {
  std::random_device rd;
  std::ostringstream os;
  os << "/fsdp." << ::getpid() << "." << std::hex << ((uint64_t(rd()) << 32) ^ rd());
  *name = os.str();
  const int64_t bytes = mapping_bytes(nslots, slot_bytes);
  const int fd = ::shm_open(name->c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why = std::string("shm_open: ") + std::strerror(errno);
    return nullptr;
  }
  int err = ::ftruncate(fd, bytes) == 0 ? 0 : errno;
  if (err == 0) err = ::posix_fallocate(fd, 0, bytes);
  void* base = err == 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (err == 0 && base == MAP_FAILED) err = errno;
  ::close(fd);
  if (err != 0) {
    ::shm_unlink(name->c_str());
    *why = "cannot reserve " + std::to_string(bytes) + " bytes in /dev/shm: " + std::strerror(err);
    return nullptr;
  }
  auto seg = std::make_unique<ShmSegment>(base, nslots, slot_bytes);
  auto* h = new (base) SegHeader();
  h->nonce = nonce;
  h->slot_bytes = slot_bytes;
  h->nslots = nslots;
  h->pid = ::getpid();
  for (int i = 0; i < nslots; ++i) new (seg->slot(i)) SlotHeader();
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return seg;
}

std::unique_ptr<ShmSegment> open_segment(const std::string& name, uint64_t nonce, int nslots,
                                         int64_t slot_bytes, std::string* why) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    *why = "cannot open " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  const int64_t bytes = mapping_bytes(nslots, slot_bytes);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size != bytes) {
    ::close(fd);
    *why = name + " has " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(bytes) +
           " (ranks disagree on FSDP_SHM_SLOT_KIB?)";
    return nullptr;
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    *why = "cannot map " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  auto seg = std::make_unique<ShmSegment>(base, nslots, slot_bytes);
  const auto* h = seg->hdr();
  if (h->magic != kMagic || h->nonce != nonce || h->nslots != nslots || h->slot_bytes != slot_bytes) {
    *why = name + " is not the peer's segment (another IPC namespace?)";
    return nullptr;
  }
  return seg;
}

void ring(SegHeader* h) {
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&h->doorbell);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Operations

// The plan of an operation's stages. Not in the anonymous namespace: ShmOp holds them.
namespace shm_plan {

// One piece this rank writes into its ring.
struct Write {
  const char* src;
  int64_t bytes;
  uint64_t piece;
  int reader;  // group rank, or -1: every peer
  // All-gather: where the piece goes in this rank's own chunk of the output, copied
  // from the slot just written (still in cache) so that the shard is read once; null
  // when the shard already is that chunk.
  char* own_dst = nullptr;
  // >= 0: published in place ([Note: exchange arena]): the readers take the bytes from
  // this offset of our arena (the all-gather's own chunk once filled, or the
  // reduce-scatter's source), and the slot carries no data.
  int64_t arena_off = -1;
};

// One step this rank takes from its peers' rings, in order.
struct Read {
  enum class Kind { Copy, Reduce } kind;
  std::vector<std::pair<int, uint64_t>> pieces;  // (writer, piece); Reduce: ascending writer
  char* dst;
  int64_t bytes;
  const char* own = nullptr;  // Reduce: this rank's row
  bool via_temp = false;      // Reduce: dst is our own row; sum into a temporary first
};

struct Stage {
  std::vector<Write> writes;
  std::vector<Read> reads;
  size_t next_write = 0, next_read = 0;
  // Pieces published in place, in order: the stage is complete only once every reader
  // has released them, because until then they read our memory.
  std::vector<uint64_t> in_place;
  size_t next_release = 0;
  bool complete() const {
    return next_write == writes.size() && next_read == reads.size() && next_release == in_place.size();
  }
};

}  // namespace shm_plan
using shm_plan::Read;
using shm_plan::Stage;
using shm_plan::Write;

namespace {

// Chunk p of a buffer: bytes [off[p], off[p] + len[p]).
struct Geometry {
  std::vector<int64_t> off, len;
};

// One piece of writer w's stream within a stage: which chunk, which part of it, for whom.
struct PieceDesc {
  int chunk;
  int64_t off, len;
  int reader;  // -1: every peer
};

// The order in which writer `w` cuts a stage into pieces (see the note). Computed by the
// writer and by each reader from the same inputs, so both agree on every piece number.
std::vector<PieceDesc> layout(bool gather, int w, int n, const Geometry& g, int64_t slot) {
  std::vector<PieceDesc> out;
  if (gather) {
    for (int64_t o = 0; o < g.len[w]; o += slot) out.push_back({w, o, std::min(slot, g.len[w] - o), -1});
    return out;
  }
  int64_t longest = 0;
  for (int p = 0; p < n; ++p) longest = std::max(longest, g.len[p]);
  for (int64_t o = 0; o < longest; o += slot) {
    for (int k = 1; k < n; ++k) {
      const int p = (w + k) % n;
      if (o < g.len[p]) out.push_back({p, o, std::min(slot, g.len[p] - o), p});
    }
  }
  return out;
}

}  // namespace

// [Note: checked slots]
// Piece numbers are never sent, so ranks that issue different collectives (another size,
// another op, one more or one fewer) would read each other's pieces as if they matched and
// complete with wrong data. Every piece therefore carries its operation's number on the
// channel, kind and size in bytes, and a reader that finds other values than its own
// fails the operation naming both sides, before it uses the bytes.
struct ShmOp {
  std::string name;
  uint64_t number = 0;   // 1, 2, ... in issue order on the channel
  uint32_t kind = 0;     // 1 all-gather, 2 reduce-scatter, 3 all-reduce
  int64_t bytes = 0;     // the flat buffer (all-gather, reduce-scatter) or the tensor
  std::vector<Stage> stages;
  size_t stage = 0;
  size_t writes_total = 0, writes_done = 0;
  at::ScalarType dtype = at::kFloat;
  ReduceOp reduce = ReduceOp::Sum;
  std::vector<at::Tensor> keep;    // what the pieces point into
  std::atomic<int64_t>* written = nullptr;   // this op's counter in shm_slot_counters()
  std::atomic<int64_t>* in_place = nullptr;  // and in shm_in_place_counters()
  bool done = false;
};

ShmChannel::~ShmChannel() {
  if (!engine_) return;  // set-up failed before registering
  std::lock_guard<std::mutex> lock(engine_->mutex());
  engine_->remove_locked(this);
}

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
  if (op == ReduceOp::Max) {
    at::maximum_out(out, parts[0], parts[1]);
    for (size_t p = 2; p < parts.size(); ++p) at::maximum_out(out, out, parts[p]);
    return;
  }
  sum_rows_into(out, parts);
  if (op == ReduceOp::Avg) out.div_(static_cast<int64_t>(parts.size()));
}

const char* kind_name(uint32_t kind) {
  switch (kind) {
    case 1: return "all_gather";
    case 2: return "reduce_scatter";
    case 3: return "all_reduce";
  }
  return "unknown operation";
}

// "" when the piece behind `sh` belongs to `op` as this rank issued it ([Note: checked slots]).
std::string slot_mismatch(const ShmOp& op, const std::string& writer, const SlotHeader& sh) {
  if (sh.op_number == op.number && sh.op_kind == op.kind && sh.op_bytes == op.bytes) return "";
  std::ostringstream os;
  os << writer << " sent data of its " << kind_name(sh.op_kind) << " #" << sh.op_number << " of "
     << with_thousands(sh.op_bytes) << " bytes where this rank is at " << kind_name(op.kind) << " #" << op.number
     << " of " << with_thousands(op.bytes) << " bytes: the ranks issued different collectives on this group";
  return os.str();
}

}  // namespace

bool ShmChannel::progress_locked() {
  bool moved = false;
  bool may_write = true;  // false once an earlier operation still has pieces to write
  ShmSegment& mine = *segs_[rank_];
  for (size_t i = 0; i < pending_.size();) {
    ShmOp& op = *pending_[i];
    while (op.stage < op.stages.size()) {
      Stage& st = op.stages[op.stage];
      // Writes: strictly in stream order, each into a slot its readers have released.
      while (may_write && st.next_write < st.writes.size()) {
        const Write& w = st.writes[st.next_write];
        TORCH_INTERNAL_ASSERT(w.piece == published_ + 1, "fsdp: shared-memory stream out of order");
        const int s = static_cast<int>((w.piece - 1) % nslots_);
        SlotHeader* sh = mine.slot(s);
        if (sh->readers_left.load(std::memory_order_acquire) != 0) break;
        if (w.arena_off >= 0) {
          if (w.own_dst) std::memcpy(w.own_dst, w.src, static_cast<size_t>(w.bytes));
          sh->src_off = w.arena_off;
          st.in_place.push_back(w.piece);
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
        sh->seq.store(w.piece, std::memory_order_release);
        published_ = w.piece;
        if (w.reader >= 0) {
          ring(segs_[w.reader]->hdr());
        } else {
          for (int p = 0; p < size_; ++p) {
            if (p != rank_) ring(segs_[p]->hdr());
          }
        }
        ++st.next_write;
        ++op.writes_done;
        moved = true;
      }
      // Reads: in order, each once all its pieces are there.
      while (st.next_read < st.reads.size()) {
        const Read& r = st.reads[st.next_read];
        bool ready = true;
        for (const auto& [w, piece] : r.pieces) {
          const auto* sh = segs_[w]->slot(static_cast<int>((piece - 1) % nslots_));
          if (sh->seq.load(std::memory_order_acquire) != piece) {
            ready = false;
            break;
          }
          if (mismatch_.empty()) mismatch_ = slot_mismatch(op, peer_names_[w], *sh);
          if (!mismatch_.empty()) {
            ready = false;
            break;
          }
        }
        if (!ready) break;
        auto data_of = [&](int w, uint64_t piece) -> const char* {
          const int s = static_cast<int>((piece - 1) % nslots_);
          const int64_t off = segs_[w]->slot(s)->src_off;
          if (off < 0) return segs_[w]->data(s);
          TORCH_INTERNAL_ASSERT(arenas_[w] && off + r.bytes <= arenas_[w]->bytes(),
                                "fsdp: a peer published a piece outside its exchange arena");
          return arenas_[w]->base() + off;
        };
        if (r.kind == Read::Kind::Copy) {
          std::memcpy(r.dst, data_of(r.pieces[0].first, r.pieces[0].second), static_cast<size_t>(r.bytes));
        } else {
          std::vector<const char*> rows(static_cast<size_t>(size_));
          rows[rank_] = r.own;
          for (const auto& [w, piece] : r.pieces) rows[w] = data_of(w, piece);
          const int64_t count = r.bytes / static_cast<int64_t>(c10::elementSize(op.dtype));
          char* out = r.via_temp ? temp_.get() : r.dst;
          reduce_rows(op.dtype, op.reduce, out, rows, count);
          if (r.via_temp) std::memcpy(r.dst, out, static_cast<size_t>(r.bytes));
        }
        for (const auto& [w, piece] : r.pieces) {
          auto* sh = segs_[w]->slot(static_cast<int>((piece - 1) % nslots_));
          if (sh->readers_left.fetch_sub(1, std::memory_order_acq_rel) == 1) ring(segs_[w]->hdr());
        }
        ++st.next_read;
        moved = true;
      }
      // Releases of our in-place pieces, in order (a slot taken by a later piece was
      // released before it).
      while (st.next_release < st.in_place.size()) {
        const uint64_t piece = st.in_place[st.next_release];
        const SlotHeader* sh = mine.slot(static_cast<int>((piece - 1) % nslots_));
        if (sh->seq.load(std::memory_order_acquire) == piece &&
            sh->readers_left.load(std::memory_order_acquire) != 0)
          break;
        ++st.next_release;
        moved = true;
      }
      if (!st.complete()) break;
      ++op.stage;  // the next stage's writes may read what this one produced
    }
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

namespace {

// Appends to `st` this rank's writes and reads of one stage and advances the writers'
// piece counters. gather: every rank's chunk (from `src`, ours) goes to every peer's
// `dst` at the chunk's offset. reduce: chunk p of every rank's `src` goes to rank p, which
// reduces them into `dst` (its own chunk's output).
void build_stage(Stage& st, bool gather, int me, int n, const Geometry& geo, int64_t slot,
                 std::vector<uint64_t>& assigned, const char* src, char* dst, bool via_temp,
                 const ShmArena* arena) {
  std::vector<std::vector<PieceDesc>> lay(static_cast<size_t>(n));
  for (int w = 0; w < n; ++w) lay[w] = layout(gather, w, n, geo, slot);
  const uint64_t my_base = assigned[me];
  for (size_t k = 0; k < lay[me].size(); ++k) {
    const auto& d = lay[me][k];
    const char* from = gather ? src + d.off : src + geo.off[d.chunk] + d.off;
    char* own = gather ? dst + geo.off[me] + d.off : nullptr;
    // In place when what the readers take lies in our arena: the gathered own chunk
    // (filled from the shard first), or the reduce-scatter's source.
    const int64_t arena_off = arena ? arena->offset_of(gather ? own : from, d.len) : -1;
    st.writes.push_back({from, d.len, my_base + k + 1, d.reader, own == from ? nullptr : own, arena_off});
  }
  if (gather) {
    // Interleaved by offset so that every peer's stream drains evenly.
    int64_t longest = 0;
    for (int w = 0; w < n; ++w) longest = std::max(longest, geo.len[w]);
    for (int64_t o = 0, j = 0; o < longest; o += slot, ++j) {
      for (int k = 1; k < n; ++k) {
        const int w = (me + k) % n;
        if (o >= geo.len[w]) continue;
        Read r{Read::Kind::Copy, {{w, assigned[w] + j + 1}}, dst + geo.off[w] + o, std::min(slot, geo.len[w] - o)};
        st.reads.push_back(std::move(r));
      }
    }
  } else {
    // Where in each writer's stream our segment at offset o sits.
    std::vector<std::vector<uint64_t>> piece_of(static_cast<size_t>(n));
    for (int w = 0; w < n; ++w) {
      if (w == me) continue;
      for (size_t k = 0; k < lay[w].size(); ++k) {
        if (lay[w][k].reader == me) piece_of[w].push_back(assigned[w] + k + 1);
      }
    }
    size_t j = 0;
    for (int64_t o = 0; o < geo.len[me]; o += slot, ++j) {
      Read r{Read::Kind::Reduce, {}, dst + o, std::min(slot, geo.len[me] - o)};
      r.own = src + geo.off[me] + o;
      r.via_temp = via_temp;
      for (int w = 0; w < n; ++w) {
        if (w != me) r.pieces.emplace_back(w, piece_of[w].at(j));
      }
      st.reads.push_back(std::move(r));
    }
  }
  for (int w = 0; w < n; ++w) assigned[w] += lay[w].size();
}


}  // namespace

std::shared_ptr<ShmOp> ShmChannel::all_gather(const at::Tensor& flat, const at::Tensor& shard) {
  auto op = std::make_shared<ShmOp>();
  op->name = "all_gather";
  op->kind = 1;
  op->bytes = nbytes(flat);
  op->written = &shm_slot_counters().all_gather;
  op->in_place = &shm_in_place_counters().all_gather;
  op->dtype = flat.scalar_type();
  op->keep = {flat, shard};
  const int64_t c = nbytes(shard);
  Geometry geo;
  for (int p = 0; p < size_; ++p) {
    geo.off.push_back(p * c);
    geo.len.push_back(c);
  }
  op->stages.emplace_back();
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());  // assigned_ is shared with progress
    build_stage(op->stages.back(), true, rank_, size_, geo, slot_bytes_, assigned_,
                static_cast<const char*>(shard.data_ptr()), static_cast<char*>(flat.data_ptr()), false,
                own_arena_.get());
  }
  return issue(std::move(op));
}

std::shared_ptr<ShmOp> ShmChannel::reduce_scatter(const at::Tensor& out, const at::Tensor& flat, ReduceOp rop) {
  auto op = std::make_shared<ShmOp>();
  op->name = "reduce_scatter";
  op->kind = 2;
  op->bytes = nbytes(flat);
  op->written = &shm_slot_counters().reduce_scatter;
  op->in_place = &shm_in_place_counters().reduce_scatter;
  op->dtype = flat.scalar_type();
  op->reduce = rop;
  op->keep = {out, flat};
  const int64_t c = nbytes(out);
  Geometry geo;
  for (int p = 0; p < size_; ++p) {
    geo.off.push_back(p * c);
    geo.len.push_back(c);
  }
  op->stages.emplace_back();
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    build_stage(op->stages.back(), false, rank_, size_, geo, slot_bytes_, assigned_,
                static_cast<const char*>(flat.data_ptr()), static_cast<char*>(out.data_ptr()), false,
                own_arena_.get());
  }
  return issue(std::move(op));
}

std::shared_ptr<ShmOp> ShmChannel::all_reduce(const at::Tensor& t, ReduceOp rop) {
  auto op = std::make_shared<ShmOp>();
  op->name = "all_reduce";
  op->kind = 3;
  op->bytes = nbytes(t);
  op->written = &shm_slot_counters().all_reduce;
  op->in_place = &shm_in_place_counters().all_reduce;
  op->dtype = t.scalar_type();
  op->reduce = rop;
  op->keep = {t};
  // Near-equal chunks of whole elements: chunk p holds elements [numel*p/n, numel*(p+1)/n).
  const int64_t numel = t.numel(), item = static_cast<int64_t>(t.element_size());
  Geometry geo;
  for (int p = 0; p < size_; ++p) {
    const int64_t b = numel * p / size_, e = numel * (p + 1) / size_;
    geo.off.push_back(b * item);
    geo.len.push_back((e - b) * item);
  }
  char* base = static_cast<char*>(t.data_ptr());
  op->stages.resize(2);
  {
    std::lock_guard<std::mutex> lock(engine_->mutex());
    // Stage 1 reduces into our own chunk of t, which is also our row: via the temporary.
    // In place, stage 1 lets the peers read our rows of t while we write our own chunk
    // (which no peer reads in stage 1); stage 2 overwrites row p only with what peer p
    // published after its stage 1, i.e. after it read our row p.
    build_stage(op->stages[0], false, rank_, size_, geo, slot_bytes_, assigned_, base,
                base + geo.off[rank_], true, own_arena_.get());
    // Stage 2 gathers the reduced chunks back into t.
    build_stage(op->stages[1], true, rank_, size_, geo, slot_bytes_, assigned_, base + geo.off[rank_],
                base, false, own_arena_.get());
  }
  return issue(std::move(op));
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
    for (const auto& [w, piece] : st.reads[st.next_read].pieces) {
      const auto* sh = segs_[w]->slot(static_cast<int>((piece - 1) % nslots_));
      if (sh->seq.load(std::memory_order_acquire) != piece) waiting.push_back(w);
    }
  }
  std::ostringstream os;
  if (!waiting.empty()) {
    os << "no data from ";
    for (size_t i = 0; i < waiting.size(); ++i) os << (i ? ", " : "") << peer_names_[waiting[i]];
  } else {
    os << "peers did not take the data this rank wrote (its ring stayed full, or pieces it published in "
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

void ShmChannel::wait(ShmOp& op) {
  using clock = std::chrono::steady_clock;
  ShmEngine& e = *engine_;
  const auto start = clock::now();
  auto next_check = start + std::chrono::milliseconds(100);
  SegHeader* h = segs_[rank_]->hdr();
  // Fails this wait, and tells the peers (they fail fast instead of timing out).
  auto fail = [&](const std::string& cause) {
    const std::string msg = failure(op, cause);
    {
      std::lock_guard<std::mutex> lock(e.mutex());
      if (broken_.empty()) broken_ = msg;
    }
    if (h->failed.load(std::memory_order_relaxed) == 0) {
      std::snprintf(h->reason, sizeof(h->reason), "%s", cause.c_str());
      h->failed.store(1, std::memory_order_release);
    }
    TORCH_CHECK(false, msg);
  };
  int idle = 0;
  std::string mismatch;  // [Note: checked slots]
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(e.mutex());
      if (op.done) return;
      TORCH_CHECK(broken_.empty(), "fsdp: ", op.name, " on group '", group_name_, "' (rank ", rank_,
                  "): the group's shared-memory transport failed earlier: ", broken_);
      const bool moved = e.progress_locked();
      if (op.done) return;
      mismatch = mismatch_;
      if (moved && mismatch.empty()) {
        idle = 0;
        continue;
      }
    }
    if (!mismatch.empty()) fail(mismatch);
    // Spin a little: a peer one piece behind publishes within microseconds.
    if (++idle < 64) {
      for (int k = 0; k < 32; ++k) cpu_relax();
      continue;
    }
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t bell = h->doorbell.load(std::memory_order_seq_cst);
    bool moved = false, done = false;
    {
      std::lock_guard<std::mutex> lock(e.mutex());
      moved = e.progress_locked();
      done = op.done;
    }
    if (!moved && !done) {
      // Other channels with pending work ring other doorbells: sleep shorter then.
      bool others = false;
      {
        std::lock_guard<std::mutex> lock(e.mutex());
        others = e.pending_locked(this);
      }
      futex_wait(&h->doorbell, bell, std::chrono::microseconds(others ? 1000 : 50000));
    }
    h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (done) return;
    idle = moved ? 0 : idle;
    const auto now = clock::now();
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(100);
      const std::string problem = peer_problem();
      if (!problem.empty()) fail(problem);
      if (now - start >= timeout_) {
        std::string blocked;
        {
          std::lock_guard<std::mutex> lock(e.mutex());
          blocked = blocking_peers(op);
        }
        fail("timed out after " + std::to_string(timeout_.count()) + " ms: " + blocked);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Set-up

std::shared_ptr<ShmChannel> make_shm_channel(const ProcessGroup& g, std::shared_ptr<ShmEngine> engine,
                                             int64_t slot_bytes, bool direct) {
  TORCH_INTERNAL_ASSERT(engine != nullptr && slot_bytes > 0);
  const int n = g.size(), me = g.rank();
  if (n == 1) return nullptr;
  const auto& store = g.store();
  const std::string prefix = "fsdp/shm/" + g.name() + "/";
  const int nslots = std::max(kMinSlots, 2 * (n - 1));
  std::random_device rd;
  const uint64_t nonce = (uint64_t(rd()) << 32) ^ rd();

  std::shared_ptr<ShmChannel> ch(new ShmChannel());
  ch->group_name_ = g.name();
  ch->rank_ = me;
  ch->size_ = n;
  ch->global_rank_ = g.global_rank();
  ch->timeout_ = g.timeout();
  ch->slot_bytes_ = slot_bytes;
  ch->nslots_ = nslots;
  ch->assigned_.assign(static_cast<size_t>(n), 0);
  ch->segs_.resize(static_cast<size_t>(n));
  ch->arenas_.resize(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) ch->peer_names_.push_back(g.describe_peer(p));

  std::string name, why, arena_why;
  ch->segs_[me] = create_segment(nslots, slot_bytes, nonce, &name, &why);
  std::shared_ptr<ShmArena> arena;
  if (direct) {
    std::lock_guard<std::mutex> lock(engine->mutex());
    arena = engine->own_arena_locked(&arena_why);
  }
  const std::string host = host_identity();
  std::ostringstream mine;
  if (ch->segs_[me]) {
    mine << "ok " << host << " " << name << " " << nonce << " ";
    if (arena) {
      mine << ::getpid() << " " << arena->fd() << " " << arena->nonce();
    } else {
      mine << "- - -";
    }
  } else {
    mine << "no " << host;
  }
  store->set(prefix + "seg/" + std::to_string(me), store_bytes(mine.str()));

  bool ok = ch->segs_[me] != nullptr;
  for (int p = 0; p < n && ok; ++p) {
    if (p == me) continue;
    std::istringstream is(store_string(store->get(prefix + "seg/" + std::to_string(p))));
    std::string status, their_host, their_name, apid, afd, anonce;
    uint64_t their_nonce = 0;
    is >> status >> their_host >> their_name >> their_nonce >> apid >> afd >> anonce;
    if (status != "ok" || their_host != host) {
      ok = false;  // another host, or the peer could not create its segment
      break;
    }
    ch->segs_[p] = open_segment(their_name, their_nonce, nslots, slot_bytes, &why);
    ok = ch->segs_[p] != nullptr;
    if (ok && apid != "-" && arena_why.empty()) {
      std::lock_guard<std::mutex> lock(engine->mutex());
      ch->arenas_[p] = engine->peer_arena_locked(std::stoi(apid), std::stoi(afd), std::stoull(anonce), &arena_why);
    }
  }
  // Verdict: segments mapped ("1"), and every published arena mapped too ("1 1").
  const bool arenas_ok = ok && arena_why.empty();
  store->set(prefix + "ok/" + std::to_string(me), store_bytes(ok ? (arenas_ok ? "1 1" : "1 0") : "0"));
  bool all_ok = true, all_arenas = true;
  for (int p = 0; p < n; ++p) {
    const std::string v = store_string(store->get(prefix + "ok/" + std::to_string(p)));
    all_ok &= v.rfind("1", 0) == 0;
    all_arenas &= v == "1 1";
  }
  // Every member has mapped our segment or given up: the name is no longer needed.
  if (!name.empty()) ::shm_unlink(name.c_str());
  if (!all_ok) {
    if (me == 0 && !why.empty()) {
      std::fprintf(stderr, "fsdp: group '%s' uses Gloo for all its collectives, not shared memory: %s\n",
                   g.name().c_str(), why.c_str());
    }
    return nullptr;
  }
  ch->temp_.reset(new char[static_cast<size_t>(slot_bytes)]);
  // In-place pieces only where every member can read every arena: otherwise the rings.
  if (all_arenas) {
    ch->own_arena_ = std::move(arena);
  } else {
    ch->arenas_.assign(static_cast<size_t>(n), nullptr);
    if (me == 0 && direct) {
      std::fprintf(stderr, "fsdp: group '%s' copies through its shared-memory rings only: %s\n", g.name().c_str(),
                   arena_why.empty() ? "a peer could not map an exchange arena" : arena_why.c_str());
    }
  }
  std::lock_guard<std::mutex> lock(engine->mutex());
  engine->add_locked(ch.get());
  ch->engine_ = std::move(engine);
  return ch;
}

}  // namespace fsdp::comm::detail
