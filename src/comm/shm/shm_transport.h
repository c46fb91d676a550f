#pragma once
// Internal to src/comm: the transport of a group whose ranks all run on this host (see
// [Note: transports] in transport.h and [Note: shared-memory transport] in
// shm_channel.cpp). All-gather, reduce-scatter and all-reduce go through the group's
// shared-memory channel; broadcast and barrier, and every call while
// set_comm_shared_memory(false), through the group's Gloo transport.
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "comm/transport.h"

namespace fsdp::comm::detail {

class ShmChannel;

class ShmTransport final : public Transport {
 public:
  /// `gloo`: the group's Gloo transport, which takes what the channel does not.
  ShmTransport(std::shared_ptr<ShmChannel> channel, std::shared_ptr<Transport> gloo);

  Issued all_gather(const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard) override;
  Issued reduce_scatter(const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat, ReduceOp op) override;
  Issued all_reduce(const GroupDesc& g, const at::Tensor& t, ReduceOp op) override;
  Issued broadcast(const GroupDesc& g, const at::Tensor& t, int root) override;
  void barrier(const GroupDesc& g) override;
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupDesc& g, const std::string& op) override;
  at::DataPtr allocate_direct(size_t nbytes) override;
  MappableChunk allocate_mappable_chunk(const GroupDesc& g, int64_t chunk_bytes) override;
  std::unique_ptr<FlatMapping> map_flat(std::vector<int64_t> offsets, int64_t chunk_bytes) override;

  const std::shared_ptr<ShmChannel>& channel() const { return channel_; }

 private:
  std::shared_ptr<ShmChannel> channel_;
  std::shared_ptr<Transport> gloo_;
};

}  // namespace fsdp::comm::detail
