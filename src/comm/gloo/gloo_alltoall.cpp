// [Note: small buffers over Gloo's alltoall]
// At N >= 3 and flat buffers of at most comm_alltoall_max_bytes() (default 2 MiB), all-gather
// and reduce-scatter go through one Gloo alltoall into (reduce-scatter) or out of
// (all-gather) a scratch buffer of the flat size, instead of send/recv (gloo_p2p.cpp):
//   - Why: with ranks sharing cores, every wake-up waits for a core, and our send/recv took
//     about three times as long as Gloo's alltoall of the same bytes at N=4, 1 MiB
//     (docs/benchmarks.md). Gloo's alltoall posts every message on one buffer from its
//     worker thread and waits for completions in any order, where each c10d send/recv is
//     its own buffer and work waited in turn; posting order was ruled out as the cause.
//     Above ~4 MiB the transfer dominates and send/recv matched or beat alltoall (and it
//     skips the copies below), hence the threshold.
//   - reduce-scatter: alltoall(scratch <- flat), then the same rank-order sum of the N rows
//     into the output (our own row is Gloo's copy of it): the same bits as send/recv.
//   - all-gather: alltoall(flat <- scratch), the scratch holding the shard N times (a copy
//     of the flat size on our side; what goes on the wire is still (N-1) shards).
//   - Only at N >= 3: at N=2 there is one peer, one send and one recv, and alltoall saved
//     nothing measurable.
//   - These run on Gloo's worker threads, so they queue behind collectives already issued
//     on the group; small ones are short.
//   - Checked rows: an all-gather and a reduce-scatter of the same flat size move the same
//     bytes through the same alltoall, so ranks that issued different ones would exchange
//     each other's data without a word. Each row therefore travels behind a header of the
//     op and its flat size, and a row whose header is not this rank's op fails the call
//     naming both sides. The rows live in the scratch (two of them: what goes, what comes),
//     which costs one more copy of the flat size than the bare exchange did.
#include "gloo_alltoall.h"

#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "gloo_transport.h"
#include "comm/row_sum.h"
#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

namespace {

// `t`'s bytes, not owning them.
at::Tensor byte_view(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous(), "alltoall: a flat buffer must be contiguous");
  return at::from_blob(t.data_ptr(), {nbytes(t)}, t.options().dtype(at::kByte));
}

// `bytes` read as `like.numel()` elements of `like`'s dtype, not owning them.
at::Tensor typed_view(const at::Tensor& bytes, const at::Tensor& like) {
  return at::from_blob(bytes.data_ptr(), {like.numel()}, like.options());
}

// What precedes each row on the wire ("Checked rows" in the note above).
struct RowHeader {
  uint32_t magic;
  uint32_t op;  // 1: all_gather, 2: reduce_scatter
  int64_t flat_bytes;
};
constexpr uint32_t kRowMagic = 0x46534450;  // "FSDP"
constexpr int64_t kHeaderBytes = 64;        // keeps every row's payload 64-byte aligned
static_assert(sizeof(RowHeader) <= kHeaderBytes);

const char* op_name(uint32_t op) {
  return op == 1 ? "all_gather" : op == 2 ? "reduce_scatter" : "an unknown collective";
}

// n rows of a header then `row_bytes` of payload, in a kByte tensor.
struct Rows {
  at::Tensor bytes;  // [n, kHeaderBytes + row_bytes]
  int64_t row_bytes;

  at::Tensor payload(int p) const { return bytes[p].narrow(0, kHeaderBytes, row_bytes); }
  void stamp(uint32_t op, int64_t flat_bytes) {
    const RowHeader h{kRowMagic, op, flat_bytes};
    for (int64_t p = 0; p < bytes.size(0); ++p) std::memcpy(bytes[p].data_ptr(), &h, sizeof h);
  }
  // "" when every row came from a rank at this same call.
  std::string mismatch(const GroupDesc& g, uint32_t op, int64_t flat_bytes) const {
    for (int p = 0; p < g.size(); ++p) {
      RowHeader h;
      std::memcpy(&h, bytes[p].data_ptr(), sizeof h);
      if (h.magic == kRowMagic && h.op == op && h.flat_bytes == flat_bytes) continue;
      std::ostringstream os;
      os << g.describe_peer(p) << " sent a row of its " << (h.magic == kRowMagic ? op_name(h.op) : "an unknown collective")
         << " of " << h.flat_bytes << " bytes where this rank is at " << op_name(op) << " of " << flat_bytes
         << " bytes: the ranks issued different collectives on this group";
      return os.str();
    }
    return "";
  }
};

// The scratch of one Gloo alltoall. Gloo's work object keeps the tensors it was given
// until its worker thread lets go of the work, which can be after wait() has returned:
// the scratch would outlive the call by a moment (two units' gathers in a row would
// briefly hold three buffers; send/recv works are ours and do not). So Gloo gets
// non-owning views of the rows (the caller's tensors never reach it), and the lease holds
// the scratch until the work is complete, then gives it back to the group, kept if large
// ([Note: per-group comm state]).
struct AlltoallLease {
  std::shared_ptr<GlooTransport> transport;
  GroupDesc group;
  at::Tensor scratch;  // kByte, from GroupCommState::acquire_scratch; the rows live here
  c10::intrusive_ptr<c10d::Work> work;

  AlltoallLease(GlooTransport& t, GroupDesc g, int64_t scratch_bytes)
      : transport(t.shared_from_this()), group(std::move(g)),
        scratch(t.comm_state().acquire_scratch(scratch_bytes)) {}
  AlltoallLease(const AlltoallLease&) = delete;
  AlltoallLease& operator=(const AlltoallLease&) = delete;

  // Rows number `which` (0: what goes, 1: what comes) of n rows of `row_bytes` each, on the
  // scratch (not owning it).
  Rows rows(int which, int n, int64_t row_bytes) const {
    const int64_t stride = kHeaderBytes + row_bytes;
    auto* base = static_cast<uint8_t*>(scratch.data_ptr()) + which * n * stride;
    return Rows{at::from_blob(base, {n, stride}, scratch.options()), row_bytes};
  }
  void start(const Rows& out, const Rows& in) {
    at::Tensor o = out.bytes, i = in.bytes;  // non-owning views of the scratch
    std::vector<int64_t> equal_splits;
    work = group.c10d()->alltoall_base(o, i, equal_splits, equal_splits);
  }
  void wait(const char* op) { transport->wait(work, group, op); }
  // After the work completed.
  void release() {
    work.reset();
    transport->comm_state().release_scratch(std::move(scratch));
  }
  ~AlltoallLease() {
    // A handle dropped without wait() while Gloo may still read or write: leak the
    // scratch rather than free it under Gloo's feet.
    if (work && !work->isCompleted()) new at::Tensor(std::move(scratch));
  }
};

}  // namespace

// The two rows of one call: what goes and what comes, each row `chunk_bytes` behind its header.
int64_t scratch_bytes(int n, int64_t chunk_bytes) { return 2 * n * (kHeaderBytes + chunk_bytes); }

void check_rows(const Rows& received, const GroupDesc& g, uint32_t op, int64_t flat_bytes) {
  const std::string m = received.mismatch(g, op, flat_bytes);
  TORCH_CHECK(m.empty(), m);
}

Issued alltoall_all_gather(GlooTransport& t, const GroupDesc& g, const at::Tensor& flat,
                           const at::Tensor& shard) {
  constexpr uint32_t kOp = 1;
  const int n = g.size();
  const int64_t chunk = nbytes(shard), flat_bytes = nbytes(flat);
  auto lease = std::make_shared<AlltoallLease>(t, g, scratch_bytes(n, chunk));
  Rows going = lease->rows(0, n, chunk), coming = lease->rows(1, n, chunk);
  going.stamp(kOp, flat_bytes);
  const at::Tensor shard_bytes = byte_view(shard.contiguous());
  for (int p = 0; p < n; ++p) going.payload(p).copy_(shard_bytes);
  lease->start(coming, going);
  return Issued{{}, [lease, coming, flat, n, flat_bytes]() {
    lease->wait("all_gather");
    check_rows(coming, lease->group, kOp, flat_bytes);
    const at::Tensor out = byte_view(flat).view({n, coming.row_bytes});
    for (int p = 0; p < n; ++p) out[p].copy_(coming.payload(p));
    lease->release();
  }, CommPath::kGloo};
}

Issued alltoall_reduce_scatter(GlooTransport& t, const GroupDesc& g, const at::Tensor& out,
                               const at::Tensor& flat, ReduceOp op) {
  constexpr uint32_t kOp = 2;
  const int n = g.size();
  const int64_t chunk = nbytes(out), flat_bytes = nbytes(flat);
  auto lease = std::make_shared<AlltoallLease>(t, g, scratch_bytes(n, chunk));
  Rows going = lease->rows(0, n, chunk), coming = lease->rows(1, n, chunk);
  going.stamp(kOp, flat_bytes);
  const at::Tensor in = byte_view(flat).view({n, chunk});
  for (int p = 0; p < n; ++p) going.payload(p).copy_(in[p]);
  lease->start(coming, going);
  return Issued{{}, [lease, coming, out, n, op, flat_bytes]() mutable {
    lease->wait("reduce_scatter");
    check_rows(coming, lease->group, kOp, flat_bytes);
    // Every row is here (ours as Gloo's copy); `flat` was copied out before the call, so
    // `out` may alias it.
    std::vector<at::Tensor> parts;
    for (int p = 0; p < n; ++p) parts.push_back(typed_view(coming.payload(p), out));
    sum_rows_into(out, parts);
    if (op == ReduceOp::kAvg) out.div_(n);
    parts.clear();
    lease->release();
  }, CommPath::kGloo};
}

}  // namespace fsdp::comm::detail
