#pragma once
// How much memory a device has, and the most it has held, for placement decisions
// (ZeroOptions::gpu_margin_mem_ratio). CUDA through libtorch: the capacity is the device's
// memory times the caching allocator's memory fraction (setMemoryFraction, 1 unless set), the
// peak the allocator's peak allocated bytes. Other devices, and builds without CUDA, report
// zeros: nothing is known, so nothing is placed there.
#include <cstdint>
#include <functional>

#include <c10/core/Device.h>

namespace fsdp::memory {

struct DeviceMemory {
  int64_t capacity = 0;        ///< bytes this process may allocate on the device
  int64_t peak_allocated = 0;  ///< the most it has allocated there so far
};

DeviceMemory device_memory(const c10::Device& device);

/// Caps what the caching allocator may hand out on a CUDA device to `fraction` of its memory
/// (CUDACachingAllocator::setMemoryFraction): tests that stand in for a smaller GPU. Throws
/// without CUDA.
void set_device_memory_fraction(const c10::Device& device, double fraction);

/// Tests: device_memory() answers with `probe` instead (an empty function restores it). Lets
/// a CPU-only machine exercise the placement a GPU's numbers would choose.
void set_device_memory_probe_for_testing(std::function<DeviceMemory(const c10::Device&)> probe);

}  // namespace fsdp::memory
