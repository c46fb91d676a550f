// Compiled with FSDP_WITH_CUDA_STREAMS when libtorch has CUDA (CMakeLists.txt), outside the
// PCH and the unity batches; without it the backend refuses to be made.
#include "cuda_streams.h"

#include <array>
#include <chrono>
#include <optional>

#include <c10/util/Exception.h>

// Events and the stream guard are c10's device-generic ones (c10::Event, c10::StreamGuard), not
// at::cuda::CUDAEvent and c10::cuda::CUDAStreamGuard, whose inline code calls the CUDA runtime:
// through libc10_cuda, our programs load no CUDA runtime of their own beside the wheel's
// (test_runtime_libraries).
#ifdef FSDP_WITH_CUDA_STREAMS
#include <c10/core/Event.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/core/StreamGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fsdp::core::detail {

#ifdef FSDP_WITH_CUDA_STREAMS

namespace {

struct CudaEvent : EventImpl {
  c10::Event event{c10::DeviceType::CUDA};  // timing off: only ordering
};

class CudaStreams : public StreamBackend {
 public:
  CudaStreams(c10::DeviceIndex device, CudaStreamDelay delay) : delay_(delay) {
    streams_[index(StreamKind::kCompute)] = c10::cuda::getCurrentCUDAStream(device);
    // Communication gets high priority, as in PyTorch FSDP: a collective's kernels
    // should not queue behind a long compute kernel.
    streams_[index(StreamKind::kAllGather)] = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
    streams_[index(StreamKind::kReduceScatter)] = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
    streams_[index(StreamKind::kCopy)] = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
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

  // A side stream is made current only to issue its collective, so this is where a test's
  // delay goes: queued on compute first, work that a side stream must wait for (a cast, a
  // flattened gradient, the last reads of a reused block) then runs late on the device,
  // and a missing producer-side wait shows as other values.
  std::shared_ptr<void> make_current(StreamKind s) override {
    if (s != StreamKind::kCompute && delayed(StreamKind::kCompute)) {
      c10::StreamGuard on_compute(stream(StreamKind::kCompute));
      at::cuda::sleep(delay_.cycles);
    }
    auto guard = std::make_shared<c10::StreamGuard>(stream(s));
    if (s != StreamKind::kCompute && delayed(s)) at::cuda::sleep(delay_.cycles);
    return guard;
  }

  std::shared_ptr<DeviceClock> device_clock() override;

  // The pool hands a block to any stream and reuses it without the caching allocator
  // seeing (FakeStreams checks that order). What the allocator must know is the end: when
  // the pool lets the block go, the allocator records an event on every stream named here
  // and reuses the memory only after them.
  void adopt_block(const at::DataPtr& block) override {
    for (StreamKind s : {StreamKind::kAllGather, StreamKind::kReduceScatter, StreamKind::kCopy})
      c10::cuda::CUDACachingAllocator::recordStream(block, stream(s));
  }

 private:
  static size_t index(StreamKind s) { return static_cast<size_t>(s); }
  bool delayed(StreamKind s) const { return delay_.stream == s && delay_.cycles > 0; }
  c10::cuda::CUDAStream stream(StreamKind s) const { return *streams_[index(s)]; }

  std::array<std::optional<c10::cuda::CUDAStream>, kStreamKinds> streams_;
  CudaStreamDelay delay_;
};

// Timed events on the streams, placed on the tracer's wall clock through one origin event
// the host waited for (so its wall time is known to within the wait's return).
class CudaClock : public DeviceClock {
 public:
  explicit CudaClock(std::array<c10::cuda::CUDAStream, 3> streams) : streams_(streams) {
    origin_.record(streams_[0]);
    origin_.synchronize();
    origin_us_ = std::chrono::duration_cast<std::chrono::microseconds>(
                     std::chrono::system_clock::now().time_since_epoch()).count();
  }
  std::shared_ptr<void> mark(int tid) override {
    auto ev = std::make_shared<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);  // timing on
    ev->record(streams_.at(static_cast<size_t>(tid)));
    return ev;
  }
  int64_t time_us(const std::shared_ptr<void>& event) override {
    auto* ev = static_cast<c10::Event*>(event.get());
    ev->synchronize();
    return origin_us_ + static_cast<int64_t>(origin_.elapsedTime(*ev) * 1000.0);
  }

 private:
  std::array<c10::cuda::CUDAStream, 3> streams_;
  c10::Event origin_{c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT};
  int64_t origin_us_ = 0;
};

std::shared_ptr<DeviceClock> CudaStreams::device_clock() {
  return std::make_shared<CudaClock>(std::array<c10::cuda::CUDAStream, 3>{
      stream(StreamKind::kCompute), stream(StreamKind::kAllGather), stream(StreamKind::kReduceScatter)});
}

}  // namespace

bool cuda_streams_built() { return true; }

std::shared_ptr<StreamBackend> make_cuda_streams(int device, CudaStreamDelay delay) {
  return std::make_shared<CudaStreams>(static_cast<c10::DeviceIndex>(device), delay);
}

#else

bool cuda_streams_built() { return false; }

std::shared_ptr<StreamBackend> make_cuda_streams(int device, CudaStreamDelay) {
  TORCH_CHECK(false, "fsdp: CUDA streams for device ", device, " were asked for, but this fsdp-cpp was built "
              "against a libtorch without CUDA; build against a CUDA libtorch (docs/gpu.md)");
}

#endif

}  // namespace fsdp::core::detail
