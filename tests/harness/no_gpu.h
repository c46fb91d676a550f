#pragma once
// The gpu-labelled cases skip, saying why, where torch sees no CUDA device; ctest counts them
// as skipped (SKIP_REGULAR_EXPRESSION "no CUDA device" in tests/CMakeLists.txt).
#include <string>

#include <torch/cuda.h>

namespace fsdp::testing {

inline bool no_gpu(std::string* why) {
  if (torch::cuda::is_available()) return false;
  *why = "no CUDA device visible (the gpu-labelled cases run on a GPU machine: scripts/gpu_check.sh)";
  return true;
}

}  // namespace fsdp::testing
