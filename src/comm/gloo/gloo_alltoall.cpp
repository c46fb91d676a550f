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
#include "gloo_alltoall.h"

#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "gloo_transport.h"
#include "comm/row_sum.h"
#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

namespace {

// The tensors of one Gloo alltoall. Gloo's work object keeps the tensors it was given
// until its worker thread lets go of the work, which can be after wait() has returned:
// the caller's flat buffer and our scratch would outlive the call by a moment (two units'
// gathers in a row would briefly hold three buffers; send/recv works are ours and do not).
// So Gloo gets non-owning views, and the lease holds the tensors themselves until the
// work is complete, then lets go (the scratch goes back to the group, kept if large:
// [Note: per-group comm state]).
struct AlltoallLease {
  std::shared_ptr<GlooTransport> transport;
  ProcessGroup group;
  at::Tensor scratch;             // kByte, from GroupCommState::acquire_scratch
  std::vector<at::Tensor> owned;  // what the views handed to Gloo point into
  c10::intrusive_ptr<c10d::Work> work;

  AlltoallLease(GlooTransport& t, ProcessGroup g, int64_t scratch_bytes)
      : transport(t.shared_from_this()), group(std::move(g)),
        scratch(t.comm_state().acquire_scratch(scratch_bytes)) {}
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
    at::Tensor o = lend(gloo_wire_view(out)), i = lend(gloo_wire_view(in));
    std::vector<int64_t> equal_splits;
    work = group.c10d()->alltoall_base(o, i, equal_splits, equal_splits);
  }
  void wait(const char* op) { transport->wait(work, group, op); }
  // After the work completed.
  void release() {
    work.reset();
    owned.clear();
    transport->comm_state().release_scratch(std::move(scratch));
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

}  // namespace

CommHandle alltoall_all_gather(GlooTransport& t, const ProcessGroup& g, const at::Tensor& flat,
                               const at::Tensor& shard) {
  const int n = g.size();
  auto lease = std::make_shared<AlltoallLease>(t, g, nbytes(flat));
  auto repeated = lease->on_scratch(flat);
  auto rows = repeated.view({n, shard.numel()});
  for (int p = 0; p < n; ++p) rows[p].copy_(shard);
  lease->start(flat, repeated);
  return CommHandle({}, g, "all_gather", [lease]() {
    lease->wait("all_gather");
    lease->release();
  }, CommPath::Gloo);
}

CommHandle alltoall_reduce_scatter(GlooTransport& t, const ProcessGroup& g, const at::Tensor& out,
                                   const at::Tensor& flat, ReduceOp op) {
  const int n = g.size();
  auto lease = std::make_shared<AlltoallLease>(t, g, nbytes(flat));
  auto received = lease->on_scratch(flat);
  lease->start(received, flat);
  auto rows = received.view({n, out.numel()});
  return CommHandle({}, g, "reduce_scatter", [lease, out, rows, n, op]() mutable {
    lease->wait("reduce_scatter");
    // Every row is here (ours as Gloo's copy) and `flat` is no longer read, so `out` may
    // alias it.
    std::vector<at::Tensor> parts;
    for (int p = 0; p < n; ++p) parts.push_back(rows[p]);
    sum_rows_into(out, parts);
    if (op == ReduceOp::Avg) out.div_(n);
    rows = at::Tensor();
    lease->release();
  }, CommPath::Gloo);
}

}  // namespace fsdp::comm::detail
