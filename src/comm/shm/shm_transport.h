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

class GlooTransport;
class ShmChannel;

class ShmTransport final : public Transport {
 public:
  ShmTransport(std::shared_ptr<ShmChannel> channel, std::shared_ptr<GlooTransport> gloo);

  CommHandle all_gather(const ProcessGroup& g, const at::Tensor& flat, const at::Tensor& shard) override;
  CommHandle reduce_scatter(const ProcessGroup& g, const at::Tensor& out, const at::Tensor& flat,
                            ReduceOp op) override;
  CommHandle all_reduce(const ProcessGroup& g, const at::Tensor& t, ReduceOp op) override;
  CommHandle broadcast(const ProcessGroup& g, const at::Tensor& t, int root) override;
  void barrier(const ProcessGroup& g) override;
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const ProcessGroup& g,
            const std::string& op) override;
  at::DataPtr allocate_direct(size_t nbytes) override;
  std::vector<std::shared_ptr<ShmArena>> exchange_arenas() const override;

  const std::shared_ptr<ShmChannel>& channel() const { return channel_; }

 private:
  std::shared_ptr<ShmChannel> channel_;
  std::shared_ptr<GlooTransport> gloo_;
};

}  // namespace fsdp::comm::detail
