#pragma once
// Internal to src/comm: the transport every group can use, over the group's c10d Gloo
// process group (see [Note: transports] in transport.h). The algorithm is chosen per call:
// all-gather and reduce-scatter of flat buffers of at most comm_alltoall_max_bytes() at
// N >= 3 go through Gloo's alltoall (gloo_alltoall.h), the others through segmented
// send/recv (gloo_p2p.h); all-reduce, broadcast and barrier are Gloo's own.
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "comm/group_comm_state.h"
#include "comm/transport.h"

namespace fsdp::comm::detail {

class ShmEngine;

class GlooTransport final : public Transport, public std::enable_shared_from_this<GlooTransport> {
 public:
  /// `engine`: the world's shared-memory engine, moved by every wait of this transport
  /// while it has pending operations; nullptr when the world has no shared memory.
  explicit GlooTransport(std::shared_ptr<ShmEngine> engine) : engine_(std::move(engine)) {}

  Issued all_gather(const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard) override;
  Issued reduce_scatter(const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat,
                        ReduceOp op) override;
  Issued all_reduce(const GroupDesc& g, const at::Tensor& t, ReduceOp op) override;
  Issued broadcast(const GroupDesc& g, const at::Tensor& t, int root) override;
  void barrier(const GroupDesc& g) override;
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupDesc& g, const std::string& op) override;

  /// Tags and scratch buffers of this group ([Note: per-group comm state]).
  GroupCommState& comm_state() { return comm_state_; }

 private:
  std::shared_ptr<ShmEngine> engine_;
  GroupCommState comm_state_;
};

/// `t` as Gloo can carry it: bf16 as a kByte view of its bytes ([Note: bf16 over Gloo] in
/// gloo_transport.cpp), any other dtype as is.
at::Tensor gloo_wire_view(const at::Tensor& t);

}  // namespace fsdp::comm::detail
