// The choke point ([Note: the collective choke point] in collective_call.h).
#include "collective_call.h"

#include <atomic>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "collective_check.h"
#include "flight_exchange.h"
#include "flight_recorder.h"
#include "tensor_bytes.h"
#include "transport.h"

namespace fsdp::comm::detail {

namespace {

struct Observers {
  std::mutex mu;
  std::vector<std::pair<int, CollectiveObserver>> list;
  std::atomic<int> count{0};  // read without the lock on every call
  int next_id = 0;
};

Observers& observers() {
  static Observers o;
  return o;
}

void notify(const ProcessGroup& g, const CollectiveCall& call) {
  Observers& o = observers();
  if (o.count.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> lock(o.mu);
  for (const auto& entry : o.list) entry.second(g, call);
}

// Bytes this rank sends as the algorithm moves them (CommCounters in collectives.h).
void count(const ProcessGroup& g, const CollectiveCall& c) {
  const int64_t n = g.size();
  switch (c.op) {
    case CollectiveOp::kAllGather: comm_counters().all_gather += nbytes(c.in) * (n - 1); break;
    case CollectiveOp::kReduceScatter: comm_counters().reduce_scatter += nbytes(c.out) * (n - 1); break;
    case CollectiveOp::kAllReduce: comm_counters().all_reduce += 2 * nbytes(c.out) * (n - 1) / n; break;
    case CollectiveOp::kBroadcast:
      if (g.rank() == c.root) comm_counters().broadcast += nbytes(c.out);
      break;
    case CollectiveOp::kBarrier: break;
  }
}

// A group of one rank: nothing moves, but the results are what the op defines.
CommHandle complete_locally(const CollectiveCall& c) {
  if (c.op == CollectiveOp::kAllGather || c.op == CollectiveOp::kReduceScatter) {
    if (c.out.data_ptr() != c.in.data_ptr()) c.out.copy_(c.in);
  }
  return CommHandle();
}

// "all_reduce on group 'world' (backward blocks.1) on rank 0": how errors name a call.
std::string describe_call(const ProcessGroup& g, const CollectiveCall& c) {
  std::ostringstream os;
  os << to_string(c.op) << " on group '" << g.name() << "' (" << c.label.describe() << ") on rank " << g.rank();
  return os.str();
}

// The device of a call's tensors: CPU tensors take the group's transport, CUDA tensors its
// device transport ([Note: CUDA tensors in a process group] in device/cuda_backend.cpp).
// Anything else, a call mixing devices, or CUDA tensors on a group that moves none is
// refused before anything moves, naming the call.
Transport& transport_for(const ProcessGroup& g, const CollectiveCall& c) {
  const at::Tensor& first = c.out.defined() ? c.out : c.in;
  if (!first.defined()) return *g.transport();
  const at::Device d = first.device();
  TORCH_CHECK(!c.in.defined() || c.in.device() == d, "fsdp: ", describe_call(g, c), ": its tensors are on ", d, " and ",
              c.in.device(), "; put both on one device");
  if (d.is_cpu()) return *g.transport();
  TORCH_CHECK(d.is_cuda() && g.device_transport(), "fsdp: ", describe_call(g, c), ": the tensor is on ", d,
              ", but this group moves ",
              d.is_cuda() ? "no CUDA tensors (a rank of the world has no GPU, or this build has no CUDA; see "
                            "fsdp::comm::Backend)"
                          : "CPU and CUDA tensors only");
  TORCH_CHECK(!d.has_index() || d.index() == g.cuda_device(), "fsdp: ", describe_call(g, c), ": the tensor is on ", d,
              " but this rank is bound to cuda:", g.cuda_device(), " (InitOptions::device_index)");
  return *g.device_transport();
}

// The caller's handle of what the transport issued: waited through the group's transport
// (or its device transport), under the call's op name.
CommHandle handle_of(Issued issued, const ProcessGroup& g, const CollectiveCall& call) {
  CommHandle handle(std::move(issued.work), g, to_string(call.op), std::move(issued.finish), issued.path);
  if (issued.on_device) handle.on_device();
  return handle;
}

CommHandle hand_to_transport(Transport& t, const ProcessGroup& g, const CollectiveCall& call) {
  const GroupDesc& d = g.desc();
  switch (call.op) {
    case CollectiveOp::kAllGather: return handle_of(t.all_gather(d, call.out, call.in), g, call);
    case CollectiveOp::kReduceScatter: return handle_of(t.reduce_scatter(d, call.out, call.in, call.reduce), g, call);
    case CollectiveOp::kAllReduce: return handle_of(t.all_reduce(d, call.out, call.reduce), g, call);
    case CollectiveOp::kBroadcast: return handle_of(t.broadcast(d, call.out, call.root), g, call);
    case CollectiveOp::kBarrier: t.barrier(d); return CommHandle();
  }
  TORCH_INTERNAL_ASSERT(false, "fsdp: unknown collective op");
}

}  // namespace

const char* to_string(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
    case CollectiveOp::kAllReduce: return "all_reduce";
    case CollectiveOp::kBroadcast: return "broadcast";
    case CollectiveOp::kBarrier: return "barrier";
  }
  return "?";
}

at::ScalarType CollectiveCall::dtype() const {
  if (op == CollectiveOp::kReduceScatter) return in.scalar_type();
  return out.defined() ? out.scalar_type() : at::kByte;
}

int64_t CollectiveCall::numel() const {
  if (op == CollectiveOp::kReduceScatter) return in.numel();
  return out.defined() ? out.numel() : 0;
}

CommHandle issue(const ProcessGroup& g, CollectiveCall call) {
  // A call passed no label takes its thread's scope (call_label.h).
  if (call.label.empty()) call.label = scope_label();
  Transport& t = transport_for(g, call);
  notify(g, call);
  // A one-rank group completes CPU calls locally; CUDA calls still go to the backend, so
  // that a one-GPU run issues what a many-GPU run does.
  if (g.size() == 1 && &t == g.transport().get()) return complete_locally(call);
  count(g, call);
  FlightRecorder& recorder = g.flight_recorder();
  const uint64_t seq = recorder.record(call);
  if (g.checks_collectives()) {
    try {
      check_before_issue(g, recorder.at(seq));
    } catch (...) {
      recorder.fail(seq);
      throw;
    }
  }
  CommHandle handle;
  try {
    handle = hand_to_transport(t, g, call);
  } catch (const std::exception& e) {
    fail_collective(g, seq, e);
  }
  if (handle.defined()) handle.attach_record(g, seq);
  else recorder.complete(seq);
  return handle;
}

int add_collective_observer(CollectiveObserver observer) {
  Observers& o = observers();
  std::lock_guard<std::mutex> lock(o.mu);
  const int id = o.next_id++;
  o.list.emplace_back(id, std::move(observer));
  o.count.store(static_cast<int>(o.list.size()), std::memory_order_release);
  return id;
}

void remove_collective_observer(int id) {
  Observers& o = observers();
  std::lock_guard<std::mutex> lock(o.mu);
  for (auto it = o.list.begin(); it != o.list.end(); ++it) {
    if (it->first == id) {
      o.list.erase(it);
      break;
    }
  }
  o.count.store(static_cast<int>(o.list.size()), std::memory_order_release);
}

}  // namespace fsdp::comm::detail
