// See shm_transport.h.
#include "shm_transport.h"

#include <ATen/ATen.h>

#include "comm/comm_tuning.h"
#include "comm/tensor_bytes.h"
#include "shm_arena.h"
#include "shm_channel.h"
#include "shm_mapped_view.h"

namespace fsdp::comm::detail {

namespace {

// set_comm_shared_memory(false) sends this call over Gloo (read per call: benchmarks and
// tests compare the two transports in one run).
bool shm_on() { return comm_tuning().shared_memory.load(); }

Issued issued_on_channel(std::shared_ptr<ShmChannel> ch, std::shared_ptr<ShmOp> shm_op) {
  return Issued{{}, [ch = std::move(ch), shm_op = std::move(shm_op)]() { ch->wait(*shm_op); }, CommPath::kSharedMemory};
}

}  // namespace

ShmTransport::ShmTransport(std::shared_ptr<ShmChannel> channel, std::shared_ptr<Transport> gloo)
    : channel_(std::move(channel)), gloo_(std::move(gloo)) {
  TORCH_INTERNAL_ASSERT(channel_ && gloo_);
}

Issued ShmTransport::all_gather(const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard) {
  if (!shm_on()) return gloo_->all_gather(g, flat, shard);
  // The channel moves the peers' chunks and fills ours as it writes our fragments.
  return issued_on_channel(channel_, channel_->all_gather(flat, shard));
}

Issued ShmTransport::reduce_scatter(const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat, ReduceOp op) {
  if (!shm_on()) return gloo_->reduce_scatter(g, out, flat, op);
  if (!overlaps(out, flat)) return issued_on_channel(channel_, channel_->reduce_scatter(out, flat, op));
  // An output inside `flat` would be written while parts of `flat` may still wait to be
  // copied out: reduce into a temporary and copy it at the end.
  auto acc = at::empty_like(out);
  Issued inner = issued_on_channel(channel_, channel_->reduce_scatter(acc, flat, op));
  return Issued{{}, [finish = std::move(inner.finish), out, acc]() {
    finish();
    out.copy_(acc);
  }, CommPath::kSharedMemory};
}

Issued ShmTransport::all_reduce(const GroupDesc& g, const at::Tensor& t, ReduceOp op) {
  if (!shm_on()) return gloo_->all_reduce(g, t, op);
  return issued_on_channel(channel_, channel_->all_reduce(t, op));
}

Issued ShmTransport::broadcast(const GroupDesc& g, const at::Tensor& t, int root) {
  return gloo_->broadcast(g, t, root);
}

void ShmTransport::barrier(const GroupDesc& g) { gloo_->barrier(g); }

at::DataPtr ShmTransport::allocate_direct(size_t nbytes) { return channel_->allocate_direct(nbytes); }

MappableChunk ShmTransport::allocate_mappable_chunk(const GroupDesc& g, int64_t chunk_bytes) {
  // A mapped flat buffer reads the arenas directly: only while the rings are in use.
  if (!shm_on()) return {};
  const auto arenas = channel_->exchange_arenas();
  if (arenas.empty()) return {};
  // At the page offset that this rank's chunk has in the flat buffer, so whole pages line up.
  const auto& mine = arenas[static_cast<size_t>(g.rank())];
  const int64_t phase = g.rank() * chunk_bytes % kArenaPage;
  MappableChunk chunk;
  chunk.memory = mine->allocate(static_cast<size_t>(chunk_bytes), phase);
  if (chunk.memory) chunk.offset = mine->offset_of(chunk.memory.get(), chunk_bytes);
  return chunk;
}

std::unique_ptr<FlatMapping> ShmTransport::map_flat(std::vector<int64_t> offsets, int64_t chunk_bytes) {
  return std::make_unique<ShmMappedView>(channel_->exchange_arenas(), std::move(offsets), chunk_bytes);
}

void ShmTransport::wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupDesc& g, const std::string& op) {
  gloo_->wait(work, g, op);
}

}  // namespace fsdp::comm::detail
