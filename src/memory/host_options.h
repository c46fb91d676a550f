#pragma once
// Where offloaded tensors live (cpu_offload, FSDP's and ZeRO's): host memory,
// pinned when the compute side is a GPU, so that the copies between the two are DMA and a
// copy to the host may run without waiting.
#include <c10/core/TensorOptions.h>

namespace fsdp::memory {

/// `compute`'s dtype and layout in host memory, pinned when `compute` is on a CUDA device.
inline c10::TensorOptions host_options(const c10::TensorOptions& compute) {
  return compute.device(c10::kCPU).pinned_memory(compute.device().is_cuda());
}

}  // namespace fsdp::memory
