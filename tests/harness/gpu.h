#pragma once
// FSDP_SKIP_WITHOUT_GPU(devices): the one way a case skips for want of CUDA devices. It skips,
// saying why, when torch sees no CUDA device or fewer than `devices`, and marks the skip as a GPU
// skip, the only kind after which a test binary may exit 77 (ctest: skipped) instead of passing
// or failing ([Note: skips], harness/skips.h). Use it at the top of a TEST body, before any
// run_ranks: a skip inside a rank worker fails the test.
//
//   TEST(FsdpCuda, ParityWithPlainTrainingOnTheGpu) {
//     FSDP_SKIP_WITHOUT_GPU(1);  // the ranks share one GPU
//     ...
//   }
#include <string>

#include <gtest/gtest.h>

namespace fsdp::testing {

/// Why this process cannot run a case that needs `devices` CUDA devices, or "" when it can.
/// A reason is also noted as the running case's GPU skip (note_gpu_skip, harness/skips.h).
std::string gpu_skip_reason(int devices);

}  // namespace fsdp::testing

// A macro, since GTEST_SKIP returns from the test body it is written in.
#define FSDP_SKIP_WITHOUT_GPU(devices)                                                         \
  if (const std::string fsdp_gpu_skip_reason_ = ::fsdp::testing::gpu_skip_reason(devices);    \
      !fsdp_gpu_skip_reason_.empty())                                                          \
  GTEST_SKIP() << fsdp_gpu_skip_reason_
