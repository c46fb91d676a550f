#pragma once
// Internal to src/core: the stream order's CUDA backend ([Note: stream order] in
// stream_order.h): compute is the device's current stream when made, the all-gather,
// reduce-scatter and copy streams come from libtorch's stream pool; record and wait are
// CUDA events (at::cuda::CUDAEvent) on them. It checks nothing: FakeStreams checks the
// same calls on the CPU.
#include <cstdint>
#include <memory>
#include <optional>

#include "stream_order.h"

namespace fsdp::core::detail {

/// Whether this build has the CUDA backend (libtorch built with CUDA).
bool cuda_streams_built();
/// What a test injects: a spin of `cycles` before each collective's issue, on `stream`: on the
/// all-gather or reduce-scatter stream when it is made current for its collective (the consumer
/// side is late), or on compute just before that (the producer side is late).
struct CudaStreamDelay {
  std::optional<StreamKind> stream;
  int64_t cycles = 0;
};

/// The backend on CUDA device `device`; refuses when cuda_streams_built() is false.
std::shared_ptr<StreamBackend> make_cuda_streams(int device, CudaStreamDelay delay = {});

}  // namespace fsdp::core::detail
