#include "fsdp/dist/collectives.h"

#include <algorithm>
#include <chrono>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "group_comm_state.h"
#include "row_sum.h"
#include "shm_channel.h"

namespace fsdp::dist {

CommCounters& comm_counters() {
  static CommCounters counters;
  return counters;
}

int64_t padded_numel(int64_t numel, int64_t size) {
  TORCH_INTERNAL_ASSERT(size > 0);
  return (numel + size - 1) / size * size;
}

CommHandle::CommHandle(c10::intrusive_ptr<c10d::Work> work, ProcessGroup group, std::string op,
                       std::function<void()> finish)
    : work_(std::move(work)), group_(std::move(group)), op_(std::move(op)),
      finish_(std::move(finish)) {}

namespace {

// Waits for one c10d work of `op` on `g`, turning a failure into our error message.
// While shared-memory operations are pending, this rank keeps moving them as it waits:
// a peer may need them to get to the Gloo operation we wait on ([Note: shared-memory
// transport]).
void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const ProcessGroup& g,
               const std::string& op) {
  try {
    if (detail::shm_pending()) {
      const auto deadline = std::chrono::steady_clock::now() + g.timeout();
      while (!work->isCompleted() && detail::shm_pending() &&
             std::chrono::steady_clock::now() < deadline) {
        if (!detail::progress_all_shm()) std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    work->wait(g.timeout());
  } catch (const std::exception& e) {
    // c10::Error's what() carries a C++ backtrace; the message alone is the news.
    const auto* ce = dynamic_cast<const c10::Error*>(&e);
    const char* cause = ce ? ce->what_without_backtrace() : e.what();
    TORCH_CHECK(false, "fsdp: ", op, " on group '", g.name(), "' failed on rank ", g.rank(),
                " of ", g.size(), " (world rank ", g.global_rank(), ", timeout ",
                g.timeout().count(), " ms): ", cause, g.dead_peers_hint(),
                ". Another rank probably exited or stopped calling collectives; check its log");
  }
}

}  // namespace

void CommHandle::wait() {
  if (done_) return;
  done_ = true;
  if (work_) wait_work(work_, group_, op_);
  if (finish_) finish_();
  work_.reset();
  finish_ = nullptr;
}

namespace {

void check_dense(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.defined() && t.is_contiguous() && t.layout() == at::kStrided, "fsdp: ", op,
              ": ", what, " must be a defined, contiguous, dense tensor");
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// [Note: bf16 over Gloo]
// Gloo in libtorch 1.13 rejects kBFloat16 ("Invalid scalar type") in every
// collective; kHalf works. All-gather and all_to_all only move bytes, so a
// bf16 tensor travels as a kByte view of its storage (exact; Gloo has no
// kShort either), and reduce-scatter sums the received rows locally in the real
// dtype. (Both now use send/recv, which only move bytes; the view keeps any
// dtype check of the transport out of the way.) all_reduce
// of bf16 sums in fp32 and rounds once (more bytes, better sum).
at::Tensor wire_view(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? t.view(at::kByte) : t;
}

// All-gather and reduce-scatter move each chunk in segments of about this many bytes, so
// reduce-scatter's sum of segment k runs while later segments are still on the wire.
std::atomic<int64_t>& segment_bytes() {
  static std::atomic<int64_t> bytes{int64_t(4) << 20};
  return bytes;
}

// Flat buffers of at most this many bytes go through Gloo's alltoall (see the note below).
std::atomic<int64_t>& alltoall_max_bytes() {
  static std::atomic<int64_t> bytes{int64_t(2) << 20};
  return bytes;
}

std::atomic<bool>& shared_memory_on() {
  static std::atomic<bool> on{true};
  return on;
}

// The group's shared-memory channel when it has one and the transport is on.
std::shared_ptr<detail::ShmChannel> shm_for(const ProcessGroup& g) {
  if (!shared_memory_on().load()) return nullptr;
  return g.shm_channel();
}

CommHandle shm_handle(const ProcessGroup& g, const char* op, std::shared_ptr<detail::ShmChannel> ch,
                      std::shared_ptr<detail::ShmOp> shm_op) {
  return CommHandle({}, g, op, [ch = std::move(ch), shm_op = std::move(shm_op)]() { ch->wait(*shm_op); });
}

// `flat` (N chunks) as a kByte or typed view of the first bytes of a scratch buffer.
at::Tensor scratch_view(const at::Tensor& scratch, const at::Tensor& like) {
  return scratch.narrow(0, 0, nbytes(like)).view(like.scalar_type());
}

// The tensors of one Gloo alltoall. Gloo's work object keeps the tensors it was given
// until its worker thread lets go of the work, which can be after wait() has returned:
// the caller's flat buffer and our scratch would outlive the call by a moment (two
// units' gathers in a row briefly held three buffers; test_state_memory saw it, send/
// recv never did, its works are ours). So Gloo gets non-owning views, and the lease
// holds the tensors themselves until the work is complete, then lets go (the scratch
// goes back to the group, kept if large: [Note: per-group comm state]).
struct AlltoallLease {
  ProcessGroup group;
  at::Tensor scratch;             // kByte, from detail::acquire_scratch
  std::vector<at::Tensor> owned;  // what the views handed to Gloo point into
  c10::intrusive_ptr<c10d::Work> work;

  AlltoallLease(ProcessGroup g, int64_t scratch_bytes)
      : group(std::move(g)), scratch(detail::acquire_scratch(group, scratch_bytes)) {}
  AlltoallLease(const AlltoallLease&) = delete;
  AlltoallLease& operator=(const AlltoallLease&) = delete;

  // A tensor shaped like `like` on the scratch (not owning it).
  at::Tensor on_scratch(const at::Tensor& like) const {
    return at::from_blob(scratch.data_ptr(), like.sizes(), like.options());
  }
  // `t` (which stays alive in the lease) as a non-owning view for Gloo.
  at::Tensor lend(const at::Tensor& t) {
    owned.push_back(t);
    return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
  }
  void start(const at::Tensor& out, const at::Tensor& in) {
    at::Tensor o = lend(wire_view(out)), i = lend(wire_view(in));
    std::vector<int64_t> equal_splits;
    work = group.c10d()->alltoall_base(o, i, equal_splits, equal_splits);
  }
  // After the work completed.
  void release() {
    work.reset();
    owned.clear();
    detail::release_scratch(group, std::move(scratch));
  }
  ~AlltoallLease() {
    // A handle dropped without wait() while Gloo may still read or write: leak what it
    // points into rather than free it under Gloo's feet.
    if (work && !work->isCompleted()) {
      new at::Tensor(std::move(scratch));
      new std::vector<at::Tensor>(std::move(owned));
    }
  }
};

c10::intrusive_ptr<c10d::Work> send(const ProcessGroup& g, const at::Tensor& t, int peer, int tag) {
  std::vector<at::Tensor> v{wire_view(t)};
  return g.c10d()->send(v, peer, tag);
}

c10::intrusive_ptr<c10d::Work> recv(const ProcessGroup& g, const at::Tensor& t, int peer, int tag) {
  std::vector<at::Tensor> v{wire_view(t)};
  return g.c10d()->recv(v, peer, tag);
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + nbytes(b) && b0 < a0 + nbytes(a);
}

}  // namespace

// [Note: point-to-point all-gather and reduce-scatter]
// Above alltoall_max_bytes() (default 2 MiB of flat buffer) both are built from Gloo
// send/recv, which the transport's own thread completes (they do not queue behind other
// collectives on Gloo's worker threads), instead of Gloo's allgather and
// all_to_all_single:
//   - Gloo 1.13's allgather gathers into a flat tensor it allocates itself on every call
//     and then copies it into the chunk views it was given: an allocation (page faults
//     above glibc's mmap threshold) plus a full copy. Here every rank sends its shard to
//     each peer and receives each peer's shard straight into that peer's chunk of the
//     flat buffer: (N-1) shards sent, the ring optimum, and no copy but our own chunk.
//     Large shards go in segments: one 32 MiB message per peer moved markedly slower over
//     loopback TCP than 4 MiB ones (bench_collectives, 64 MiB at N=2).
//   - all_to_all_single needed a fresh receive buffer of the whole flat size, moved every
//     byte before the local sum could start, and received our own chunk as a copy.
//     Here the chunk is cut into segments of ~segment_bytes(); every segment's messages
//     are posted up front (so the transfer proceeds while the caller computes), and
//     wait() sums segment k as soon as it has arrived while later segments are still in
//     flight. Our own row is read in place; the receive buffer holds the N-1 peer rows
//     and is leased from the group when large ([Note: per-group comm state]).
// Small flat buffers (<= alltoall_max_bytes()) go through Gloo's alltoall instead, into
// (reduce-scatter) or out of (all-gather) a leased scratch buffer of the flat size:
//   - bench_collectives at N=4 on 2 cores (every wake-up waits for a core), 1 MiB: our
//     send/recv took 3.7-4.3 ms, Gloo's alltoall of the same bytes 1.1-1.3 ms. Posting
//     order is not the cause (sends first, receives first and Gloo's interleaved order
//     all took 3.1-4.9 ms in a probe). What differs: Gloo's alltoall posts every
//     message on one UnboundBuffer from its worker thread and waits for completions in
//     any order, where each c10d send/recv is its own buffer and Work waited in turn;
//     which of these costs the time was not isolated. Above ~4 MiB the transfer
//     dominates and send/recv matched or beat alltoall (it also skips the copies below).
//   - reduce-scatter: alltoall(scratch <- flat), then the same rank-order sum of the
//     N rows into the output (our own row is Gloo's copy of it): same bits.
//   - all-gather: alltoall(flat <- scratch), the scratch holding the shard N times (a
//     copy of the flat size on our side; what goes on the wire is still (N-1) shards).
//   Only at N >= 3: at N=2 there is one peer, one send and one recv, and alltoall saved
//   nothing measurable (1 MiB, N=2: all-gather 0.40 ms over send/recv vs 0.58 ms over
//   alltoall; reduce-scatter 0.56-0.69 vs 0.65-0.67 ms, within the machine's noise).
//   These run on Gloo's worker threads, so they queue behind collectives already
//   issued on the group; small ones are short.
// The sum per element is row 0 + row 1 + ... + row N-1 in rank order on both paths,
// the same order and so the same bits, on every run (fp32/fp64 in one blocked pass,
// kernels/row_sum_kernel.h, equal bit for bit to the ATen add sequence).

void set_comm_segment_bytes(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "fsdp: set_comm_segment_bytes: expected a positive byte count, got ",
              bytes);
  segment_bytes() = bytes;
}

int64_t comm_segment_bytes() { return segment_bytes().load(); }

void set_comm_alltoall_max_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "fsdp: set_comm_alltoall_max_bytes: expected a byte count >= 0 "
              "(0 turns the alltoall path off), got ", bytes);
  alltoall_max_bytes() = bytes;
}

int64_t comm_alltoall_max_bytes() { return alltoall_max_bytes().load(); }

int64_t comm_cached_bytes() { return detail::cached_scratch_bytes(); }

void set_comm_shared_memory(bool on) { shared_memory_on() = on; }

bool comm_shared_memory() { return shared_memory_on().load(); }

CommHandle all_gather_into(const ProcessGroup& g, const at::Tensor& flat, const at::Tensor& shard) {
  check_dense(flat, "the flat buffer", "all_gather_into");
  check_dense(shard, "the shard", "all_gather_into");
  const int n = g.size();
  TORCH_CHECK(flat.numel() == shard.numel() * n && flat.scalar_type() == shard.scalar_type(),
              "fsdp: all_gather_into on group '", g.name(), "': flat buffer has ", flat.numel(),
              " elements of ", flat.scalar_type(), ", expected ", n, " x ", shard.numel(), " of ",
              shard.scalar_type());
  if (n == 1) {
    if (flat.data_ptr() != shard.data_ptr()) flat.copy_(shard);
    return CommHandle({}, g, "all_gather", {});
  }
  const int me = g.rank();
  auto chunks = flat.view({n, shard.numel()});
  auto mine = chunks[me];
  // The shard must not be overwritten by a peer's chunk while we still send it.
  TORCH_CHECK(!overlaps(shard, flat) || mine.data_ptr() == shard.data_ptr(),
              "fsdp: all_gather_into on group '", g.name(), "': the shard overlaps the flat "
              "buffer but is not this rank's chunk (rank ", me, "); pass a separate shard or "
              "flat[rank*chunk:(rank+1)*chunk]");
  const int64_t chunk = shard.numel();
  if (auto ch = shm_for(g)) {
    comm_counters().all_gather += nbytes(shard) * (n - 1);
    auto op = ch->all_gather(flat, shard);
    if (mine.data_ptr() != shard.data_ptr()) mine.copy_(shard);
    return shm_handle(g, "all_gather", std::move(ch), std::move(op));
  }
  if (n > 2 && nbytes(flat) <= alltoall_max_bytes().load()) {
    // Small: Gloo's alltoall from the shard repeated N times (see the note above).
    auto lease = std::make_shared<AlltoallLease>(g, nbytes(flat));
    auto repeated = lease->on_scratch(flat);
    auto rows = repeated.view({n, chunk});
    for (int p = 0; p < n; ++p) rows[p].copy_(shard);
    comm_counters().all_gather += nbytes(shard) * (n - 1);
    lease->start(flat, repeated);
    return CommHandle(lease->work, g, "all_gather", [lease]() { lease->release(); });
  }
  const int64_t seg = std::max<int64_t>(1, segment_bytes().load() / static_cast<int64_t>(flat.element_size()));
  const int nseg = static_cast<int>((chunk + seg - 1) / seg);
  const int tag0 = detail::reserve_tags(g, nseg);
  comm_counters().all_gather += nbytes(shard) * (n - 1);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(size_t(2) * nseg * (n - 1));
  for (int s = 0; s < nseg; ++s) {
    const int64_t c0 = s * seg, len = std::min(seg, chunk - c0);
    // Receives first, so a peer's data finds its destination already posted.
    for (int k = 1; k < n; ++k) {
      const int peer = (me + n - k) % n;
      works.push_back(recv(g, chunks[peer].narrow(0, c0, len), peer, tag0 + s));
    }
    for (int k = 1; k < n; ++k) works.push_back(send(g, shard.narrow(0, c0, len), (me + k) % n, tag0 + s));
  }
  // Our own chunk is copied while the messages are in flight.
  if (mine.data_ptr() != shard.data_ptr()) mine.copy_(shard);
  return CommHandle({}, g, "all_gather", [works, g]() {
    for (const auto& w : works) wait_work(w, g, "all_gather");
  });
}

CommHandle reduce_scatter(const ProcessGroup& g, const at::Tensor& out, const at::Tensor& flat,
                          ReduceOp op) {
  TORCH_CHECK(op != ReduceOp::Max, "fsdp: reduce_scatter supports Sum and Avg only");
  check_dense(flat, "the flat buffer", "reduce_scatter");
  check_dense(out, "the output shard", "reduce_scatter");
  const int n = g.size();
  TORCH_CHECK(flat.numel() == out.numel() * n && flat.scalar_type() == out.scalar_type(),
              "fsdp: reduce_scatter on group '", g.name(), "': flat buffer has ", flat.numel(),
              " elements of ", flat.scalar_type(), ", expected ", n, " x ", out.numel(), " of ",
              out.scalar_type());
  if (n == 1) {
    if (out.data_ptr() != flat.data_ptr()) out.copy_(flat);
    return CommHandle({}, g, "reduce_scatter", {});
  }
  const int me = g.rank();
  const int64_t chunk = out.numel();
  comm_counters().reduce_scatter += nbytes(out) * (n - 1);
  if (auto ch = shm_for(g)) {
    // An output inside `flat` would be written while parts of `flat` may still wait to
    // be copied out: then reduce into a temporary and copy it at the end.
    if (!overlaps(out, flat)) return shm_handle(g, "reduce_scatter", ch, ch->reduce_scatter(out, flat, op));
    auto acc = at::empty_like(out);
    auto inner = std::make_shared<CommHandle>(shm_handle(g, "reduce_scatter", ch, ch->reduce_scatter(acc, flat, op)));
    return CommHandle({}, g, "reduce_scatter", [inner, out, acc]() {
      inner->wait();
      out.copy_(acc);
    });
  }
  if (n > 2 && nbytes(flat) <= alltoall_max_bytes().load()) {
    // Small: Gloo's alltoall into a scratch of N rows, then the rank-order sum.
    auto lease = std::make_shared<AlltoallLease>(g, nbytes(flat));
    auto received = lease->on_scratch(flat);
    lease->start(received, flat);
    auto rows = received.view({n, chunk});
    return CommHandle(lease->work, g, "reduce_scatter", [lease, out, rows, n, op]() mutable {
      // Every row is here (ours as Gloo's copy) and `flat` is no longer read, so `out`
      // may alias it.
      std::vector<at::Tensor> parts;
      for (int p = 0; p < n; ++p) parts.push_back(rows[p]);
      detail::sum_rows_into(out, parts);
      if (op == ReduceOp::Avg) out.div_(n);
      rows = at::Tensor();
      lease->release();
    });
  }
  const int64_t seg = std::max<int64_t>(1, segment_bytes().load() / static_cast<int64_t>(flat.element_size()));
  const int nseg = static_cast<int>((chunk + seg - 1) / seg);
  auto rows = flat.view({n, chunk});
  // Peer p's row for us lands in received[slot(p)], slot(p) = p < me ? p : p - 1.
  auto scratch = detail::acquire_scratch(g, nbytes(out) * (n - 1));
  auto received = scratch_view(scratch, flat.narrow(0, 0, (n - 1) * chunk)).view({n - 1, chunk});
  const int tag0 = detail::reserve_tags(g, nseg);

  // recvs[s*(n-1) + k-1]: segment s from peer me-k; sends likewise to peer me+k.
  std::vector<c10::intrusive_ptr<c10d::Work>> recvs, sends;
  recvs.reserve(size_t(nseg) * (n - 1));
  sends.reserve(size_t(nseg) * (n - 1));
  for (int s = 0; s < nseg; ++s) {
    const int64_t c0 = s * seg, len = std::min(seg, chunk - c0);
    for (int k = 1; k < n; ++k) {
      const int peer = (me + n - k) % n;
      recvs.push_back(recv(g, received[peer < me ? peer : peer - 1].narrow(0, c0, len), peer, tag0 + s));
    }
    for (int k = 1; k < n; ++k) {
      const int peer = (me + k) % n;
      sends.push_back(send(g, rows[peer].narrow(0, c0, len), peer, tag0 + s));
    }
  }
  // Writing `out` while parts of `flat` are still being sent would corrupt them if
  // the two overlap; then sum into a temporary and copy at the end.
  const bool alias = overlaps(out, flat);
  return CommHandle({}, g, "reduce_scatter",
                    [g, out, flat, scratch, received, recvs, sends, n, me, chunk, seg, nseg, op,
                     alias]() mutable {
    auto acc = alias ? at::empty_like(out) : out;
    std::vector<at::Tensor> parts;
    parts.reserve(n);
    auto row = [&](int p, int64_t c0, int64_t len) {
      return p == me ? flat.narrow(0, int64_t(me) * chunk + c0, len)
                     : received[p < me ? p : p - 1].narrow(0, c0, len);
    };
    for (int s = 0; s < nseg; ++s) {
      for (int k = 0; k < n - 1; ++k) wait_work(recvs[size_t(s) * (n - 1) + k], g, "reduce_scatter");
      const int64_t c0 = s * seg, len = std::min(seg, chunk - c0);
      auto a = acc.narrow(0, c0, len);
      parts.clear();
      for (int p = 0; p < n; ++p) parts.push_back(row(p, c0, len));
      detail::sum_rows_into(a, parts);
      if (op == ReduceOp::Avg) a.div_(n);
    }
    for (const auto& w : sends) wait_work(w, g, "reduce_scatter");
    if (alias) out.copy_(acc);
    // Every message into the scratch has completed: the next call may have it.
    recvs.clear();
    received = at::Tensor();
    detail::release_scratch(g, std::move(scratch));
  });
}

CommHandle all_reduce(const ProcessGroup& g, const at::Tensor& t, ReduceOp op) {
  check_dense(t, "the tensor", "all_reduce");
  const int n = g.size();
  if (n == 1) return CommHandle({}, g, "all_reduce", {});
  if (t.scalar_type() == at::kBFloat16) {  // see [Note: bf16 over Gloo]
    auto wide = t.to(at::kFloat);
    auto inner = std::make_shared<CommHandle>(all_reduce(g, wide, op));
    return CommHandle({}, g, "all_reduce", [inner, wide, t]() {
      inner->wait();
      t.copy_(wide);
    });
  }
  comm_counters().all_reduce += 2 * nbytes(t) * (n - 1) / n;
  if (auto ch = shm_for(g)) return shm_handle(g, "all_reduce", ch, ch->all_reduce(t, op));
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::Max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  auto work = g.c10d()->allreduce(tensors, opts);
  return CommHandle(work, g, "all_reduce", [t, n, op]() {
    if (op == ReduceOp::Avg) t.div_(n);
  });
}

CommHandle broadcast(const ProcessGroup& g, const at::Tensor& t, int root) {
  check_dense(t, "the tensor", "broadcast");
  TORCH_CHECK(root >= 0 && root < g.size(), "fsdp: broadcast root ", root,
              " is outside group '", g.name(), "' of size ", g.size());
  if (g.size() == 1) return CommHandle({}, g, "broadcast", {});
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  if (g.rank() == root) comm_counters().broadcast += nbytes(t);
  auto work = g.c10d()->broadcast(tensors, opts);
  return CommHandle(work, g, "broadcast", [tensors]() {});
}

void barrier(const ProcessGroup& g) {
  if (g.size() == 1) return;
  // Gloo's barrier honours the group's timeout; wrap it for the error message.
  CommHandle(g.c10d()->barrier(), g, "barrier", {}).wait();
}

}  // namespace fsdp::dist
