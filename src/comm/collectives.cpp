// The collectives of collectives.h: argument checks, what every transport shares, then
// the group's transport ([Note: transports] in transport.h).
#include "fsdp/comm/collectives.h"

#include <memory>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "collective_call.h"
#include "comm/device/stream_use.h"
#include "comm_testing.h"
#include "flight_exchange.h"
#include "flight_recorder.h"
#include "group_comm_state.h"
#include "tensor_bytes.h"
#include "transport.h"

namespace fsdp::comm {

using detail::nbytes;

CommCounters& comm_counters() {
  static CommCounters counters;
  return counters;
}

int64_t padded_numel(int64_t numel, int64_t size) {
  TORCH_INTERNAL_ASSERT(size > 0);
  return (numel + size - 1) / size * size;
}

const char* to_string(CommPath path) {
  switch (path) {
    case CommPath::kLocal: return "local";
    case CommPath::kSharedMemory: return "shm";
    case CommPath::kGloo: return "gloo";
    case CommPath::kNccl: return "nccl";
  }
  return "?";
}

CommHandle::CommHandle(c10::intrusive_ptr<c10d::Work> work, ProcessGroup group, std::string op,
                       std::function<void()> finish, CommPath path)
    : work_(std::move(work)), group_(std::move(group)), op_(std::move(op)),
      finish_(std::move(finish)), path_(path) {}

void CommHandle::wait() {
  if (done_) return;
  done_ = true;
  try {
    if (work_) (on_device_ ? group_.device_transport() : group_.transport())->wait(work_, group_.desc(), op_);
    if (finish_) finish_();
  } catch (const std::exception& e) {
    work_.reset();
    finish_ = nullptr;
    if (record_seq_ == 0) throw;
    detail::fail_collective(record_group_, record_seq_, e);
  }
  work_.reset();
  finish_ = nullptr;
  if (record_seq_ != 0) record_group_.flight_recorder().complete(record_seq_);
}

void CommHandle::order_current_stream() const {
  // Gloo's CUDA work records the events that order the streams only when it ends.
  if (work_ && !done_ && path_ == CommPath::kNccl) work_->synchronize();
}

bool CommHandle::is_completed() const { return done_ || (work_ && work_->isCompleted()); }

int64_t comm_cached_bytes() { return detail::GroupCommState::cached_bytes(); }

at::DataPtr allocate_collective_buffer(const ProcessGroup& g, size_t nbytes) {
  if (g.defined() && g.size() > 1 && g.transport()) {
    if (at::DataPtr p = g.transport()->allocate_direct(nbytes)) return p;
  }
  return c10::GetAllocator(c10::DeviceType::CPU)->allocate(nbytes);
}

namespace {

void check_dense(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.defined() && t.is_contiguous() && t.layout() == at::kStrided, "fsdp: ", op,
              ": ", what, " must be a defined, contiguous, dense tensor");
}

}  // namespace

CommHandle all_gather_into(const ProcessGroup& g, const at::Tensor& flat, const at::Tensor& shard,
                           const CallLabel& label) {
  check_dense(flat, "the flat buffer", "all_gather_into");
  check_dense(shard, "the shard", "all_gather_into");
  const int n = g.size();
  TORCH_CHECK(flat.numel() == shard.numel() * n && flat.scalar_type() == shard.scalar_type(),
              "fsdp: all_gather_into on group '", g.name(), "': flat buffer has ", flat.numel(),
              " elements of ", flat.scalar_type(), ", expected ", n, " x ", shard.numel(), " of ",
              shard.scalar_type());
  if (n > 1) {
    auto mine = flat.view({n, shard.numel()})[g.rank()];
    // The shard must not be overwritten by a peer's chunk while we still send it.
    TORCH_CHECK(!detail::overlaps(shard, flat) || mine.data_ptr() == shard.data_ptr(),
                "fsdp: all_gather_into on group '", g.name(), "': the shard overlaps the flat "
                "buffer but is not this rank's chunk (rank ", g.rank(), "); pass a separate shard or "
                "flat[rank*chunk:(rank+1)*chunk]");
  }
  detail::CollectiveCall call;
  call.op = detail::CollectiveOp::kAllGather;
  call.out = flat;
  call.in = shard;
  call.label = label;
  return detail::issue(g, std::move(call));
}

CommHandle reduce_scatter(const ProcessGroup& g, const at::Tensor& out, const at::Tensor& flat,
                          ReduceOp op, const CallLabel& label) {
  TORCH_CHECK(op != ReduceOp::kMax, "fsdp: reduce_scatter supports Sum and Avg only");
  check_dense(flat, "the flat buffer", "reduce_scatter");
  check_dense(out, "the output shard", "reduce_scatter");
  const int n = g.size();
  TORCH_CHECK(flat.numel() == out.numel() * n && flat.scalar_type() == out.scalar_type(),
              "fsdp: reduce_scatter on group '", g.name(), "': flat buffer has ", flat.numel(),
              " elements of ", flat.scalar_type(), ", expected ", n, " x ", out.numel(), " of ",
              out.scalar_type());
  detail::CollectiveCall call;
  call.op = detail::CollectiveOp::kReduceScatter;
  call.out = out;
  call.in = flat;
  call.reduce = op;
  call.label = label;
  return detail::issue(g, std::move(call));
}

CommHandle all_reduce(const ProcessGroup& g, const at::Tensor& t, ReduceOp op, const CallLabel& label) {
  check_dense(t, "the tensor", "all_reduce");
  if (t.scalar_type() == at::kBFloat16 && g.size() > 1) {
    // Summed in fp32 and rounded once, on every transport (more bytes, a better sum, and
    // Gloo has no bf16: [Note: bf16 over Gloo] in gloo_transport.cpp).
    auto wide = t.to(at::kFloat);
    auto inner = std::make_shared<CommHandle>(all_reduce(g, wide, op, label));
    return CommHandle({}, g, "all_reduce", [inner, wide, t]() {
      inner->wait();
      t.copy_(wide);
      detail::used_on_current_stream(wide);  // allocated on the issuing stream, read here
    }, inner->path());
  }
  detail::CollectiveCall call;
  call.op = detail::CollectiveOp::kAllReduce;
  call.out = t;
  call.reduce = op;
  call.label = label;
  return detail::issue(g, std::move(call));
}

CommHandle broadcast(const ProcessGroup& g, const at::Tensor& t, int root, const CallLabel& label) {
  check_dense(t, "the tensor", "broadcast");
  TORCH_CHECK(root >= 0 && root < g.size(), "fsdp: broadcast root ", root,
              " is outside group '", g.name(), "' of size ", g.size());
  detail::CollectiveCall call;
  call.op = detail::CollectiveOp::kBroadcast;
  call.out = t;
  call.root = root;
  call.label = label;
  return detail::issue(g, std::move(call));
}

void barrier(const ProcessGroup& g, const CallLabel& label) {
  detail::CollectiveCall call;
  call.op = detail::CollectiveOp::kBarrier;
  call.label = label;
  detail::issue(g, std::move(call)).wait();
}

}  // namespace fsdp::comm
