#include "comm/device/device_transport.h"

#include <ATen/ATen.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/device/stream_use.h"
#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

namespace {

// Sums, then divides for Avg: Gloo has no average, and one rule keeps both backends alike.
c10d::ReduceOp c10d_op(ReduceOp op) {
  return op == ReduceOp::kMax ? c10d::ReduceOp(c10d::ReduceOp::MAX) : c10d::ReduceOp(c10d::ReduceOp::SUM);
}

}  // namespace

Issued DeviceTransport::all_gather(const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard) {
  at::Tensor out = flat;
  at::Tensor in = shard;
  auto work = g.c10d()->_allgather_base(out, in);
  return Issued{work, [out, in]() {}, path_, /*on_device=*/true};
}

Issued DeviceTransport::reduce_scatter(const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat,
                                       ReduceOp op) {
  // The output may lie inside the flat buffer: reduce into a tensor of its own then.
  at::Tensor target = overlaps(out, flat) ? at::empty_like(out) : out;
  at::Tensor input = flat;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d_op(op);
  auto work = g.c10d()->_reduce_scatter_base(target, input, opts);
  const int n = g.size();
  return Issued{work, [out, target, input, op, n]() {
    if (op == ReduceOp::kAvg) target.div_(n);
    if (!target.is_same(out)) {
      out.copy_(target);
      used_on_current_stream(target);  // allocated on the issuing stream, read here
    }
  }, path_, /*on_device=*/true};
}

Issued DeviceTransport::all_reduce(const GroupDesc& g, const at::Tensor& t, ReduceOp op) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d_op(op);
  auto work = g.c10d()->allreduce(tensors, opts);
  const int n = g.size();
  return Issued{work, [tensors, op, n]() {
    if (op == ReduceOp::kAvg) tensors[0].div_(n);
  }, path_, /*on_device=*/true};
}

Issued DeviceTransport::broadcast(const GroupDesc& g, const at::Tensor& t, int root) {
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  auto work = g.c10d()->broadcast(tensors, opts);
  return Issued{work, [tensors]() {}, path_, /*on_device=*/true};
}

void DeviceTransport::barrier(const GroupDesc& g) {
  // A barrier moves no tensor: the CPU backend's, as the group's own transport does.
  wait(g.c10d()->getBackend(c10::kCPU)->barrier(), g, "barrier");
}

std::shared_ptr<Transport> make_device_transport(const CudaCollectiveBackend& cuda) {
  if (!cuda.enabled()) return nullptr;
  return std::make_shared<DeviceTransport>(cuda.backend == Backend::kNccl ? CommPath::kNccl : CommPath::kGloo);
}

void DeviceTransport::wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupDesc& g, const std::string& op) {
  try {
    // NCCL: the current stream waits, the host does not; NCCL's watchdog enforces the
    // group's timeout (a timeout here would block the host until the work ends).
    if (path_ == CommPath::kNccl) work->wait();
    else work->wait(g.timeout());
  } catch (const std::exception& e) {
    const auto* ce = dynamic_cast<const c10::Error*>(&e);
    const char* cause = ce ? ce->what_without_backtrace() : e.what();
    TORCH_CHECK(false, "fsdp: ", op, " of CUDA tensors on group '", g.name(), "' failed on rank ", g.rank(), " of ",
                g.size(), " (world rank ", g.global_rank(), ", timeout ", g.timeout().count(), " ms): ", cause,
                g.dead_peers_hint(), ". Another rank probably exited or stopped calling collectives; check its log");
  }
}

}  // namespace fsdp::comm::detail
