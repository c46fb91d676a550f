#pragma once
// Internal to src/comm: the transport of a group's CUDA tensors ([Note: CUDA tensors in a
// process group] in cuda_backend.cpp): c10d collectives on the group's c10d::ProcessGroup,
// which hands them to the backend registered for CUDA (NCCL, or Gloo staging through host
// memory). Results are NCCL's or Gloo's sums, not the rank-order sums of the CPU transports.
#include <memory>

#include "comm/device/cuda_backend.h"
#include "comm/transport.h"

namespace fsdp::comm::detail {

class DeviceTransport final : public Transport {
 public:
  /// `path`: CommPath::kNccl or CommPath::kGloo, what the group registered for CUDA.
  explicit DeviceTransport(CommPath path) : path_(path) {}

  Issued all_gather(const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard) override;
  Issued reduce_scatter(const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat, ReduceOp op) override;
  Issued all_reduce(const GroupDesc& g, const at::Tensor& t, ReduceOp op) override;
  Issued broadcast(const GroupDesc& g, const at::Tensor& t, int root) override;
  void barrier(const GroupDesc& g) override;
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupDesc& g, const std::string& op) override;

 private:
  CommPath path_;
};

/// The device transport of a group of a world whose CUDA tensors `cuda` moves; nullptr when
/// the world moves no CUDA tensors.
std::shared_ptr<Transport> make_device_transport(const CudaCollectiveBackend& cuda);

}  // namespace fsdp::comm::detail
