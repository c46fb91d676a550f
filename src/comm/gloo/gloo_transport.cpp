// See gloo_transport.h and [Note: transports] in transport.h.
#include "gloo_transport.h"

#include <chrono>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/comm_tuning.h"
#include "gloo_alltoall.h"
#include "gloo_p2p.h"
#include "comm/shm/shm_engine.h"
#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

// [Note: bf16 over Gloo]
// Gloo in libtorch 1.13 rejects kBFloat16 ("Invalid scalar type") in every collective;
// kHalf works. All-gather and reduce-scatter only move bytes (send/recv, alltoall), so a
// bf16 tensor travels as a kByte view of its storage (exact; Gloo has no kShort either),
// and reduce-scatter sums the received rows locally in the real dtype. All-reduce never
// sees bf16 here: collectives.cpp sums it in fp32 on every transport and rounds once.
at::Tensor gloo_wire_view(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? t.view(at::kByte) : t;
}

namespace {

// Whether a flat buffer of this call goes through Gloo's alltoall ([Note: small buffers
// over Gloo's alltoall] in gloo_alltoall.cpp).
bool use_alltoall(const GroupDesc& g, const at::Tensor& flat) {
  return g.size() > 2 && nbytes(flat) <= comm_tuning().alltoall_max_bytes.load();
}

}  // namespace

Issued GlooTransport::all_gather(const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard) {
  if (use_alltoall(g, flat)) return alltoall_all_gather(*this, g, flat, shard);
  return p2p_all_gather(*this, g, flat, shard);
}

Issued GlooTransport::reduce_scatter(const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat,
                                     ReduceOp op) {
  if (use_alltoall(g, flat)) return alltoall_reduce_scatter(*this, g, out, flat, op);
  return p2p_reduce_scatter(*this, g, out, flat, op);
}

Issued GlooTransport::all_reduce(const GroupDesc& g, const at::Tensor& t, ReduceOp op) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  auto work = g.c10d()->allreduce(tensors, opts);
  const int n = g.size();
  return Issued{work, [t, n, op]() {
    if (op == ReduceOp::kAvg) t.div_(n);
  }, CommPath::kGloo};
}

Issued GlooTransport::broadcast(const GroupDesc& g, const at::Tensor& t, int root) {
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  auto work = g.c10d()->broadcast(tensors, opts);
  return Issued{work, [tensors]() {}, CommPath::kGloo};
}

void GlooTransport::barrier(const GroupDesc& g) {
  // Gloo's barrier honours the group's timeout; wait() words its failure. Called on the
  // backend: c10d::ProcessGroup::barrier keeps a one-byte tensor in a static for good,
  // memory no rank could account for.
  wait(g.c10d()->getBackend(c10::kCPU)->barrier(), g, "barrier");
}

void GlooTransport::wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupDesc& g, const std::string& op) {
  try {
    // While shared-memory operations are pending, keep moving them: a peer may need them
    // to get to the Gloo operation waited on here ([Note: shared-memory progress engine]).
    if (engine_ && engine_->pending()) {
      const auto deadline = std::chrono::steady_clock::now() + g.timeout();
      while (!work->isCompleted() && engine_->pending() && std::chrono::steady_clock::now() < deadline) {
        if (!engine_->progress()) std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    work->wait(g.timeout());
  } catch (const std::exception& e) {
    // c10::Error's what() carries a C++ backtrace; the message alone is the news.
    const auto* ce = dynamic_cast<const c10::Error*>(&e);
    const char* cause = ce ? ce->what_without_backtrace() : e.what();
    TORCH_CHECK(false, "fsdp: ", op, " on group '", g.name(), "' failed on rank ", g.rank(), " of ",
                g.size(), " (world rank ", g.global_rank(), ", timeout ", g.timeout().count(),
                " ms): ", cause, g.dead_peers_hint(),
                ". Another rank probably exited or stopped calling collectives; check its log");
  }
}

}  // namespace fsdp::comm::detail
