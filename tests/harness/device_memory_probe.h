#pragma once
// gpu_margin_mem_ratio on a CPU-only machine ([Note: auto placement] in src/engine/placement.h):
// a probe stands in for the GPU's capacity and peak, so that kRatio x the margin is `budget`
// bytes (set it once the sizes are known, before the first step). The pieces placed then move
// to the "device": another allocation on the CPU. One per process (rank workers are processes).
#include <cstdint>

#include "memory/device_memory.h"

namespace fsdp::testing {

struct DeviceMemoryProbe {
  static constexpr double kRatio = 0.5;
  int64_t budget = 0;
  DeviceMemoryProbe() {
    memory::set_device_memory_probe_for_testing([this](const c10::Device&) {
      return memory::DeviceMemory{(int64_t(1) << 20) + static_cast<int64_t>(static_cast<double>(budget) / kRatio),
                                  int64_t(1) << 20};
    });
  }
  ~DeviceMemoryProbe() { memory::set_device_memory_probe_for_testing(nullptr); }
  DeviceMemoryProbe(const DeviceMemoryProbe&) = delete;
  DeviceMemoryProbe& operator=(const DeviceMemoryProbe&) = delete;
};

}  // namespace fsdp::testing
