// See shm_transport.h.
#include "shm_transport.h"

#include <ATen/ATen.h>

#include "comm/comm_tuning.h"
#include "comm/gloo/gloo_transport.h"
#include "shm_channel.h"
#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

namespace {

// set_comm_shared_memory(false) sends this call over Gloo (read per call: benchmarks and
// tests compare the two transports in one run).
bool shm_on() { return comm_tuning().shared_memory.load(); }

CommHandle handle(const ProcessGroup& g, const char* op, std::shared_ptr<ShmChannel> ch,
                  std::shared_ptr<ShmOp> shm_op) {
  return CommHandle({}, g, op, [ch = std::move(ch), shm_op = std::move(shm_op)]() { ch->wait(*shm_op); },
                    CommPath::SharedMemory);
}

}  // namespace

ShmTransport::ShmTransport(std::shared_ptr<ShmChannel> channel, std::shared_ptr<GlooTransport> gloo)
    : channel_(std::move(channel)), gloo_(std::move(gloo)) {
  TORCH_INTERNAL_ASSERT(channel_ && gloo_);
}

CommHandle ShmTransport::all_gather(const ProcessGroup& g, const at::Tensor& flat, const at::Tensor& shard) {
  if (!shm_on()) return gloo_->all_gather(g, flat, shard);
  // The channel moves the peers' chunks and fills ours as it writes our pieces.
  return handle(g, "all_gather", channel_, channel_->all_gather(flat, shard));
}

CommHandle ShmTransport::reduce_scatter(const ProcessGroup& g, const at::Tensor& out, const at::Tensor& flat,
                                        ReduceOp op) {
  if (!shm_on()) return gloo_->reduce_scatter(g, out, flat, op);
  if (!overlaps(out, flat)) return handle(g, "reduce_scatter", channel_, channel_->reduce_scatter(out, flat, op));
  // An output inside `flat` would be written while parts of `flat` may still wait to be
  // copied out: reduce into a temporary and copy it at the end.
  auto acc = at::empty_like(out);
  auto inner = std::make_shared<CommHandle>(handle(g, "reduce_scatter", channel_, channel_->reduce_scatter(acc, flat, op)));
  return CommHandle({}, g, "reduce_scatter", [inner, out, acc]() {
    inner->wait();
    out.copy_(acc);
  }, CommPath::SharedMemory);
}

CommHandle ShmTransport::all_reduce(const ProcessGroup& g, const at::Tensor& t, ReduceOp op) {
  if (!shm_on()) return gloo_->all_reduce(g, t, op);
  return handle(g, "all_reduce", channel_, channel_->all_reduce(t, op));
}

CommHandle ShmTransport::broadcast(const ProcessGroup& g, const at::Tensor& t, int root) {
  return gloo_->broadcast(g, t, root);
}

void ShmTransport::barrier(const ProcessGroup& g) { gloo_->barrier(g); }

at::DataPtr ShmTransport::allocate_direct(size_t nbytes) { return channel_->allocate_direct(nbytes); }

std::vector<std::shared_ptr<ShmArena>> ShmTransport::exchange_arenas() const {
  // A mapped flat buffer reads the arenas directly: only while the rings are in use.
  return shm_on() ? channel_->exchange_arenas() : std::vector<std::shared_ptr<ShmArena>>{};
}

void ShmTransport::wait(const c10::intrusive_ptr<c10d::Work>& work, const ProcessGroup& g,
                        const std::string& op) {
  gloo_->wait(work, g, op);
}

}  // namespace fsdp::comm::detail
