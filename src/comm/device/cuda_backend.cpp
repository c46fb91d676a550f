// [Note: CUDA tensors in a process group]
// A group moves CPU tensors through its transport (shared memory or Gloo) and CUDA tensors
// through its device transport (device_transport.h), which issues c10d collectives on the
// group's c10d::ProcessGroup: NCCL registered for CUDA when the world chose NCCL, else Gloo,
// which stages CUDA tensors through host memory. The choice is made once per world, at
// init, from a table every rank reads alike: each rank publishes the UUID of the GPU it is
// bound to (or that it has none). NCCL refuses two ranks on one GPU ("Duplicate GPU
// detected") only once a collective runs, and then on some ranks while the others wait: the
// table finds the duplicate first, and every rank refuses with the same message. Backend::kAuto
// takes NCCL when every rank has a GPU of its own, Gloo when ranks share GPUs, and moves no
// CUDA tensors when a rank has none.
//
// This file is compiled with NCCL's header and USE_C10D_NCCL when libtorch has CUDA
// (FSDP_WITH_NCCL); without them it still decides the CUDA backend (no rank has CUDA) and refuses
// Backend::kNccl.
#include "comm/device/cuda_backend.h"

#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/store_bytes.h"
#include "fsdp/comm/process_group.h"  // InitOptions, LaunchEnv

#ifdef FSDP_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace fsdp::comm::detail {

namespace {

int visible_cuda_devices() {
#ifdef FSDP_WITH_NCCL
  try {
    return static_cast<int>(c10::cuda::device_count());
  } catch (const std::exception&) {
    return 0;  // no driver: a CPU machine
  }
#else
  return 0;
#endif
}

std::string device_uuid(int index) {
#ifdef FSDP_WITH_NCCL
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(index);
  std::ostringstream os;
  os << "GPU-";
  for (int i = 0; i < 16; ++i) {
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(p->uuid.bytes[i]));
    os << hex;
  }
  return os.str();
#else
  (void)index;
  return "";
#endif
}

// This rank's device: the explicit index, else its local rank over the visible devices. It
// becomes the calling thread's current device before any other CUDA work of the group (the
// UUID query, NCCL's communicator), so that work naming no device (a user's torch::kCUDA
// tensor, a synchronize, a context) lands on this rank's GPU and not on device 0, whichever
// launcher started the rank.
int bind_device(const InitOptions& options, const LaunchEnv& env, int visible) {
  if (visible == 0) return -1;
  const int index = options.device_index() >= 0 ? options.device_index() : env.local_rank % visible;
  TORCH_CHECK(index < visible, "fsdp: rank ", env.rank, ": InitOptions::device_index ", index, " but only ", visible,
              " CUDA device(s) are visible; pick one below ", visible, " or set CUDA_VISIBLE_DEVICES");
#ifdef FSDP_WITH_NCCL
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#endif
  return index;
}

}  // namespace

bool nccl_built() {
#ifdef FSDP_WITH_NCCL
  return true;
#else
  return false;
#endif
}

CudaCollectiveBackend decide_cuda_backend(const InitOptions& options, const LaunchEnv& env, c10d::Store& store) {
  const Backend asked = options.backend();
  const int device = bind_device(options, env, visible_cuda_devices());
  // The table: each rank's GPU UUID, or "none".
  store.set("fsdp/init/gpu/" + std::to_string(env.rank), store_bytes(device >= 0 ? device_uuid(device) : "none"));
  std::map<std::string, std::vector<int>> ranks_of;
  int without = -1;
  for (int r = 0; r < env.world_size; ++r) {
    const std::string uuid = store_string(store.get("fsdp/init/gpu/" + std::to_string(r)));
    if (uuid == "none") {
      if (without < 0) without = r;
    } else {
      ranks_of[uuid].push_back(r);
    }
  }
  std::string shared;  // "ranks 0 and 1 share GPU-..." for the first shared GPU
  for (const auto& [uuid, rs] : ranks_of) {
    if (rs.size() < 2) continue;
    std::ostringstream os;
    os << "ranks " << rs[0] << " and " << rs[1] << " share " << uuid;
    shared = os.str();
    break;
  }
  CudaCollectiveBackend p;
  if (asked == Backend::kNccl) {
    TORCH_CHECK(without < 0, "fsdp: rank ", env.rank, ": Backend::kNccl, but rank ", without,
                " has no CUDA device; every rank needs one GPU of its own (or use Backend::kGloo)");
    TORCH_CHECK(shared.empty(), "fsdp: rank ", env.rank, ": Backend::kNccl, but ", shared,
                ": NCCL refuses two ranks on one GPU; use Backend::kGloo for CUDA tensors (it stages them "
                "through host memory), or give each rank its own GPU (InitOptions::device_index, "
                "CUDA_VISIBLE_DEVICES)");
    p.backend = Backend::kNccl;
  } else if (without >= 0) {
    return p;  // some rank has no GPU: CUDA tensors are refused (none placed)
  } else if (asked == Backend::kGloo || !shared.empty() || !nccl_built()) {
    p.backend = Backend::kGloo;
  } else {
    p.backend = Backend::kNccl;
  }
  p.device_index = device;
  return p;
}

void attach_nccl(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const c10::intrusive_ptr<c10d::Store>& store,
                 int rank, int size, std::chrono::milliseconds timeout, int device_index) {
#ifdef FSDP_WITH_NCCL
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  pg->setBackend(c10::kCUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
  // After setBackend, which gives a new backend the group's own (unset) device.
  nccl->setBoundDeviceId(device);
#else
  (void)pg, (void)store, (void)rank, (void)size, (void)timeout, (void)device_index;
  TORCH_CHECK(false, "fsdp: this build has no NCCL");
#endif
}

}  // namespace fsdp::comm::detail
