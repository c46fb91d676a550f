#pragma once
// Internal to src/comm: which CUDA device a rank uses and which backend moves its CUDA
// tensors ([Note: CUDA tensors in a process group] in cuda_backend.cpp).
#include <chrono>
#include <string>

#include <c10/util/intrusive_ptr.h>

#include "fsdp/comm/types.h"

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace fsdp::comm {
struct InitOptions;
struct LaunchEnv;
}  // namespace fsdp::comm

namespace fsdp::comm::detail {

/// Which backend moves a world's CUDA tensors, and the device each rank binds: the same
/// decision on every rank; sub-groups inherit it.
struct CudaCollectiveBackend {
  /// The CUDA device this rank is bound to; -1 when the world moves no CUDA tensors.
  int device_index = -1;
  /// NCCL, Gloo (staged through host memory), or Auto meaning none: CUDA tensors refused.
  Backend backend = Backend::kAuto;
  bool enabled() const { return device_index >= 0; }
};

/// Whether this build can create NCCL process groups (libtorch with CUDA and NCCL).
bool nccl_built();

/// Decides which backend moves the world's CUDA tensors: each rank binds a device
/// (InitOptions::device_index, else its local rank modulo the visible devices) and publishes
/// the device's UUID through `store`; every rank then reads the same table and decides the same. Backend::kNccl with
/// two ranks on one GPU, or a rank without CUDA, is refused on every rank before NCCL starts
/// (a build without NCCL refuses Backend::kNccl earlier, in init_process_group).
CudaCollectiveBackend decide_cuda_backend(const InitOptions& options, const LaunchEnv& env, c10d::Store& store);

/// Registers an NCCL backend for CUDA tensors on `pg` (rank `rank` of `size`), bound to
/// `device_index`, with the group's timeout. Only when nccl_built().
void attach_nccl(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const c10::intrusive_ptr<c10d::Store>& store,
                 int rank, int size, std::chrono::milliseconds timeout, int device_index);

}  // namespace fsdp::comm::detail
