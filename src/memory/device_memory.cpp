// Compiled with FSDP_WITH_CUDA when libtorch has CUDA (CMakeLists.txt), outside the PCH and
// the unity batches. libtorch_cuda answers (device properties, the caching allocator): no CUDA
// runtime call of our own (test_runtime_libraries).
#include "device_memory.h"

#include <utility>

#include <c10/util/Exception.h>

#ifdef FSDP_WITH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace fsdp::memory {

namespace {

std::function<DeviceMemory(const c10::Device&)>& probe() {
  static std::function<DeviceMemory(const c10::Device&)> p;
  return p;
}

}  // namespace

DeviceMemory device_memory(const c10::Device& device) {
  if (probe()) return probe()(device);
  DeviceMemory m;
#ifdef FSDP_WITH_CUDA
  if (device.is_cuda()) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
    const double total = static_cast<double>(at::cuda::getDeviceProperties(index)->totalGlobalMem);
    m.capacity = static_cast<int64_t>(total * c10::cuda::CUDACachingAllocator::getMemoryFraction(index));
    constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    m.peak_allocated = c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[kAll].peak;
  }
#else
  (void)device;
#endif
  return m;
}

void set_device_memory_fraction(const c10::Device& device, double fraction) {
#ifdef FSDP_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device.has_index() ? device.index() : 0);
    return;
  }
#endif
  TORCH_CHECK(false, "set_device_memory_fraction: ", device, " is not a CUDA device of this build");
}

void set_device_memory_probe_for_testing(std::function<DeviceMemory(const c10::Device&)> p) {
  probe() = std::move(p);
}

}  // namespace fsdp::memory
