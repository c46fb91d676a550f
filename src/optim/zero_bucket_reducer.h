#pragma once
// Stage 2 of ZeroRedundancyOptimizer: gradients reduced in buckets while backward runs.
//
// [Note: ZeRO-2 gradient buckets]
// Buckets are those of the layout ([Note: ZeRO partition layout] in zero_layout.h).
// An AccumulateGrad post hook per trainable parameter copies the parameter's freshly
// accumulated gradient into its bucket's buffer (in the communication dtype) and frees
// it, so a parameter's full gradient lives only from its AccumulateGrad to its hook.
// A bucket whose parameters have all arrived is *ready*; ready buckets are issued in
// bucket order (the same on every rank, whatever order gradients arrive in), each as
// one reduce-scatter (average over the group) whose output, this rank's chunk, is added
// to this rank's gradient *partition* (or written straight into it on the first
// micro-batch since the partition was consumed). The end-of-backward callback issues
// the buckets still open, with zeros for parameters that got no gradient on this rank
// (an unused branch), and completes every reduction; so every rank issues every bucket
// once per backward, in the same order.
//
// A bucket's states are FixedBuckets' ([Note: fixed buckets] in src/engine/fixed_buckets.h),
// and its reductions in flight a ReductionWindow's ([Note: reductions in flight] in
// src/engine/reduction_window.h): with overlap_communication up to two buckets are reducing
// at a time (the oldest is completed before a third is issued); without it each is completed
// as it is issued. Under ZeroOptions::optimizer_in_backward the optimizer steps a bucket's
// chunk once its reduction completed (on_reduced), then consume()s it: the next backward
// writes the chunk afresh instead of adding to what was stepped.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "autograd/grad_accumulator_handle.h"
#include "engine/fixed_buckets.h"
#include "engine/reduction_window.h"
#include "fsdp/comm/collectives.h"
#include "zero_layout.h"

namespace torch::autograd {
struct Node;
}

namespace fsdp::optim::detail {

class ZeroBucketReducer : public std::enable_shared_from_this<ZeroBucketReducer> {
 public:
  struct Config {
    comm::ProcessGroup group;
    at::ScalarType comm_dtype = at::kFloat;
    at::ScalarType grad_dtype = at::kFloat;  // of the partition
    bool overlap = false;
  };
  /// params and names in flat order (as the layout's).
  ZeroBucketReducer(std::vector<at::Tensor> params, std::vector<std::string> names, const ZeroLayout& layout,
                  Config config);
  ~ZeroBucketReducer();

  /// Registers the AccumulateGrad post hooks (they hold a weak reference to this).
  void install_hooks();
  /// AccumulateGrad of parameter i (flat order) has run.
  void on_grad(size_t i);
  /// End of backward (engine callback; also step() for a backward whose callback never
  /// ran): issues what is left, completes every reduction.
  void finish_backward();

  /// This rank's reduced gradients (layout partition), undefined when nothing was
  /// reduced since the last clear().
  const at::Tensor& partition() const { return partition_; }
  /// Parameters that received a gradient on this rank since the last clear().
  const std::vector<uint8_t>& used() const { return used_; }
  /// Backward in progress (a hook ran, the callback did not yet).
  bool in_backward() const { return callback_queued_; }
  /// Forgets the partition and the used flags (step consumed them; zero_grad(true)).
  void clear();
  /// Zeroes the partition, keeps the used flags (zero_grad(false)).
  void zero();
  /// Called with a bucket's index once its chunk of the partition is complete (its
  /// reduction completed), in bucket order: where the optimizer steps it inside backward.
  void set_on_reduced(std::function<void(size_t bucket)> fn) { on_reduced_ = std::move(fn); }
  /// Bucket b's chunk was stepped: forget its accumulation and its parameters' used flags.
  void consume(size_t b);
  /// Partition and bucket buffers alive. Not the (at most four) freed bucket buffers the
  /// pool keeps for the next backward, as DeepSpeed keeps its reduction buffers: memory
  /// the allocator holds beyond the gradients (MemoryCategory::kOther).
  int64_t bytes() const;
  /// The freed bucket buffers the pool keeps, and releasing them.
  int64_t idle_bytes() const { return buckets_.idle_bytes(); }
  void release_idle() { buckets_.release_idle(); }

 private:
  class Reduction;
  void issue_ready();
  void issue(size_t b);
  void complete(size_t b, at::Tensor& out);
  void ensure_callback();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  const ZeroLayout& layout_;
  Config config_;
  // Bucket buffers, on memory the peers read in place ([Note: exchange arena] in
  // src/comm/shm/shm_arena.cpp) and kept between steps ([Note: buffer pool]).
  engine::FixedBuckets buckets_;
  engine::ReductionWindow in_flight_;
  std::vector<uint8_t> accumulated_;  // per bucket: its chunk holds a value since clear()
  std::vector<uint8_t> seen_;     // this backward, also after its bucket was reduced
  std::vector<uint8_t> used_;     // since clear()
  bool callback_queued_ = false;
  at::Tensor partition_;
  std::vector<autograd::GradAccumulatorHandle> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::function<void(size_t)> on_reduced_;
};

}  // namespace fsdp::optim::detail
