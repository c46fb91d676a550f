#pragma once
/// Memory tracer (ColossalAI's MemStatsCollector and dump_memory_stats): bytes by
/// category (memory_usage.h) sampled at unit boundaries of a FullyShardedDataParallel
/// model and at optimizer steps.
///
///     fsdp::memory::enable_allocator_counting();   // first thing in main(), before any tensor
///     ...
///     fsdp::MemoryTracer tracer(*model, &optimizer);
///     for (...) { loss.backward(); optimizer.step(); tracer.step(); }
///     fsdp::dump_memory_stats("memory.jsonl");
///
/// Samples: after a unit is gathered for forward ("pre_forward"), after its
/// forward ("post_forward"), after it is gathered for backward ("pre_backward"),
/// after its gradients are handed to the reduction ("post_backward"), and after
/// each optimizer step ("optimizer_step", unit "-"). Categories: parameter shards,
/// unsharded parameters (gathered buffers and flat gradients in flight), gradients
/// (this rank's pieces), optimizer state (tensors of the optimizer's per-parameter
/// state, recounted at each step), and "other": what the CPU allocator holds
/// beyond those (activations, temporaries), only when allocator counting was
/// enabled before the model was built (otherwise other = 0 and the sample says so).
/// Cost per sample: a walk over the units' sizes and one atomic read.
///
/// A model on a CUDA device (its parameters there when the tracer is made): each sample
/// also holds the CUDA caching allocator's statistics of that device (MemorySample::cuda:
/// bytes allocated, reserved, and the peak allocated since the process started or
/// torch's last peak reset), and "other" is what that allocator holds beyond the
/// categories (the CPU allocator's count does not see device memory).

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/memory/memory_usage.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace fsdp {

class FullyShardedBase;

namespace memory {
/// Installs a counting CPU allocator for the whole process (once; later calls do
/// nothing). Tensors allocated before are not counted, so call it before building
/// the model. Not combinable with another allocator installed by the program.
void enable_allocator_counting();
bool allocator_counting_enabled();
/// Live bytes allocated through the counting allocator (0 when not enabled).
int64_t counted_allocator_bytes();
/// Allocations made through it so far (0 when not enabled): what its cost scales with.
int64_t counted_allocations();
}  // namespace memory

/// The CUDA caching allocator's statistics of one device (its DeviceStats, aggregate over
/// pools); -1 where the traced model is not on a CUDA device.
struct CudaAllocatorBytes {
  int64_t allocated = -1;       ///< live bytes handed out (torch.cuda.memory_allocated)
  int64_t reserved = -1;        ///< bytes the allocator holds from the driver (memory_reserved)
  int64_t peak_allocated = -1;  ///< highest `allocated` so far (max_memory_allocated)
};

struct MemorySample {
  int64_t step = 0;     ///< optimizer steps taken before the sample
  std::string unit;     ///< unit path ("" is the root; "-" for an optimizer step)
  std::string phase;    ///< pre_forward | post_forward | pre_backward | post_backward | optimizer_step
  MemoryUsage usage;
  int64_t allocator_bytes = -1;  ///< live counted bytes; -1 when counting is not enabled
  CudaAllocatorBytes cuda;       ///< the model's CUDA device; -1s for a model on the CPU
};

class MemoryTracer {
 public:
  /// Starts sampling `model`'s unit boundaries; `optimizer` (optional, not owned)
  /// gives the optimizer-state category. One tracer per model at a time.
  explicit MemoryTracer(FullyShardedBase& model, torch::optim::Optimizer* optimizer = nullptr);
  ~MemoryTracer();
  MemoryTracer(const MemoryTracer&) = delete;
  MemoryTracer& operator=(const MemoryTracer&) = delete;

  /// Call after optimizer.step(): samples "optimizer_step" and counts the step.
  void step();
  /// Bytes by category now.
  MemoryUsage get_memory_usage();
  const std::vector<MemorySample>& samples() const { return samples_; }
  /// Global rank of the traced model's process group (written with each sample).
  int rank() const { return rank_; }
  /// Writes the samples as JSON lines, one per sample.
  void dump(const std::string& path) const;

 private:
  void sample(const std::string& unit, const char* phase);
  int64_t optimizer_state_bytes() const;

  FullyShardedBase& model_;
  torch::optim::Optimizer* optimizer_;
  int rank_ = 0;
  int64_t step_ = 0;
  int64_t optimizer_bytes_ = 0;  // recounted at each step (the state changes only there)
  int cuda_device_ = -1;         // the model's CUDA device index, -1 on the CPU
  std::vector<MemorySample> samples_;
};

/// Writes the samples of every live MemoryTracer of this process as JSON lines
/// (seed 000's dump_memory_stats). Returns the number of samples written.
int64_t dump_memory_stats(const std::string& path);

}  // namespace fsdp
