#include "fsdp/dist/collectives.h"

#include <sstream>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

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

void CommHandle::wait() {
  if (done_) return;
  done_ = true;
  if (work_) {
    try {
      work_->wait(group_.timeout());
    } catch (const std::exception& e) {
      // c10::Error's what() carries a C++ backtrace; the message alone is the news.
      const auto* ce = dynamic_cast<const c10::Error*>(&e);
      const char* cause = ce ? ce->what_without_backtrace() : e.what();
      TORCH_CHECK(false, "fsdp: ", op_, " on group '", group_.name(), "' failed on rank ",
                  group_.rank(), " of ", group_.size(), " (world rank ", group_.global_rank(),
                  ", timeout ", group_.timeout().count(), " ms): ", cause,
                  group_.dead_peers_hint(),
                  ". Another rank probably exited or stopped calling collectives; check its log");
    }
  }
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
// kShort either), and
// reduce-scatter sums the received rows locally in the real dtype. all_reduce
// of bf16 sums in fp32 and rounds once (more bytes, better sum).
at::Tensor wire_view(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? t.view(at::kByte) : t;
}

}  // namespace

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
  // Gloo receives into chunk views of the flat buffer directly.
  std::vector<std::vector<at::Tensor>> outputs(1);
  auto chunks = flat.view({n, shard.numel()});
  for (int r = 0; r < n; ++r) outputs[0].push_back(wire_view(chunks[r]));
  std::vector<at::Tensor> inputs{wire_view(shard)};
  comm_counters().all_gather += nbytes(shard) * (n - 1);
  auto work = g.c10d()->allgather(outputs, inputs);
  // Keep the views (and so the flat buffer) alive until the handle completes.
  return CommHandle(work, g, "all_gather", [outputs, inputs]() {});
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
  // all_to_all: chunk j of our buffer goes to rank j; row i of `received` is
  // rank i's chunk for us. Summing the rows in rank order makes every run
  // produce the same bits.
  auto received = at::empty_like(flat);
  comm_counters().reduce_scatter += nbytes(out) * (n - 1);
  std::vector<int64_t> equal_splits;  // empty = equal splits
  at::Tensor wire_out = wire_view(received), wire_in = wire_view(flat);
  auto work = g.c10d()->alltoall_base(wire_out, wire_in, equal_splits, equal_splits);
  const int64_t chunk = out.numel();
  return CommHandle(work, g, "reduce_scatter", [received, flat, out, n, chunk, op]() {
    auto rows = received.view({n, chunk});
    out.copy_(rows[0]);
    for (int r = 1; r < n; ++r) out.add_(rows[r]);
    if (op == ReduceOp::Avg) out.div_(n);
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
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::Max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  comm_counters().all_reduce += 2 * nbytes(t) * (n - 1) / n;
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
