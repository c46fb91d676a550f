#include "harness/gpu.h"

#include <torch/cuda.h>

#include "harness/skips.h"

namespace fsdp::testing {

std::string gpu_skip_reason(int devices) {
  const int seen = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (seen >= devices) return "";
  note_gpu_skip();
  if (seen == 0)
    return "no CUDA device visible to torch (torch::cuda::is_available() is false); the gpu-labelled "
           "cases run on a GPU machine: scripts/gpu_check.sh";
  return "needs " + std::to_string(devices) + " CUDA devices, torch sees " + std::to_string(seen);
}

}  // namespace fsdp::testing
