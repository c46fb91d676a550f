// Compiled with FSDP_WITH_CUDA_STREAMS when libtorch has CUDA (CMakeLists.txt), outside the
// PCH and the unity batches; without it the backend refuses to be made.
#include "cuda_streams.h"

#include <array>
#include <optional>

#include <c10/util/Exception.h>

#ifdef FSDP_WITH_CUDA_STREAMS
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fsdp::detail {

#ifdef FSDP_WITH_CUDA_STREAMS

namespace {

struct CudaEvent : EventImpl {
  at::cuda::CUDAEvent event;  // timing off: only ordering
};

class CudaStreams : public StreamBackend {
 public:
  explicit CudaStreams(c10::DeviceIndex device) {
    streams_[index(StreamKind::Compute)] = c10::cuda::getCurrentCUDAStream(device);
    // Communication gets high priority, as in PyTorch FSDP: a collective's kernels
    // should not queue behind a long compute kernel.
    streams_[index(StreamKind::AllGather)] = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
    streams_[index(StreamKind::ReduceScatter)] = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
    streams_[index(StreamKind::Copy)] = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
  }

  StreamEvent record(StreamKind s, std::string what) override {
    auto ev = std::make_shared<CudaEvent>();
    ev->event.record(stream(s));
    return StreamEvent{s, std::move(what), std::move(ev)};
  }

  void wait(StreamKind s, const StreamEvent& e) override {
    auto* ce = dynamic_cast<CudaEvent*>(e.impl.get());
    TORCH_INTERNAL_ASSERT(ce, "the CUDA stream order waits on an event another backend recorded");
    ce->event.block(stream(s));
  }

  // The device keeps the order; FakeStreams checks these same calls on the CPU.
  void check(StreamKind, BufferUse, const BufferRecord&) override {}

 private:
  static size_t index(StreamKind s) { return static_cast<size_t>(s); }
  c10::cuda::CUDAStream stream(StreamKind s) const { return *streams_[index(s)]; }

  std::array<std::optional<c10::cuda::CUDAStream>, kStreamKinds> streams_;
};

}  // namespace

bool cuda_streams_built() { return true; }

std::shared_ptr<StreamBackend> make_cuda_streams(int device) {
  return std::make_shared<CudaStreams>(static_cast<c10::DeviceIndex>(device));
}

#else

bool cuda_streams_built() { return false; }

std::shared_ptr<StreamBackend> make_cuda_streams(int device) {
  TORCH_CHECK(false, "fsdp: CUDA streams for device ", device, " were asked for, but this fsdp-cpp was built "
              "against a libtorch without CUDA; build against a CUDA libtorch (docs/gpu.md)");
}

#endif

}  // namespace fsdp::detail
