#pragma once
// Stage 1 of ZeroRedundancyOptimizer: the gradients backward accumulated in grad(),
// reduced in step(), bucket by bucket ([Note: ZeRO partition layout] in zero_layout.h).
// Two variants (Stage1Reduction):
//  * reduce-scatter (DeepSpeed): each bucket's average lands in this rank's chunk of a
//    gradient partition, in the gradients' dtype (widened from the communication dtype
//    when they differ);
//  * all-reduce (LowLevelZero, torch's ZeroRedundancyOptimizer): every rank keeps the
//    averaged full gradients in grad(); under mixed precision this rank's chunks are
//    also copied into the partition (the fp32 masters step from it).
//
// [Note: stage 1 buckets]
// Stage 1 flattens the gradients into buckets and reduces each in place (all-reduce, or
// reduce-scatter into the partition). The buckets come from the exchange arena, so on
// one host the peers read them in place instead of through the shared-memory rings
// (the all-reduce's two ring copies of every byte become one), and from a pool that
// keeps up to four freed buffers, as stage 2 and DeepSpeed keep their reduction
// buffers: a fresh arena block would fault its pages in on every step. Under the
// all-reduce variant the gradients then alias their buckets (see finish() in
// zero_stage1_reducer.cpp), so a bucket returns to the pool when zero_grad() drops them,
// and the pool holds it through the next backward: at most four buckets
// (reduce_bucket_size elements each, 4 MB by default) beyond what the step itself needs.
// Where glibc keeps freed memory ([Note: freed host memory]) it held the freed buckets
// for the next backward's gradients anyway, so the resident memory is the same.
// get_memory_usage() reports the idle buffers as MemoryCategory::kOther and
// empty_cache() releases them. bench_strategies compares the step time against
// ordinary memory (docs/benchmarks.md).
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "memory/buffer_pool.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "zero_layout.h"

namespace fsdp::optim::detail {

class ZeroStage1Reducer {
 public:
  struct Config {
    comm::ProcessGroup group;
    at::TensorOptions comm_options;  ///< of the buckets (the communication dtype)
    at::TensorOptions grad_options;  ///< of the partition (the pieces' gradients)
    bool all_reduce = false;         ///< Stage1Reduction::kAllReduce
    bool mixed = false;              ///< fp32 masters: the partition is kept under all-reduce too
    int window = 1;                  ///< buckets in flight
  };
  ZeroStage1Reducer(const ZeroLayout& layout, Config config);

  /// Reduces `params`' gradients (flat order; undefined ones count as zeros) over the
  /// group. Collective. Under all-reduce their grad() become the averages.
  void reduce(std::vector<at::Tensor>& params);
  /// This rank's reduced gradients, in the layout's partition; undefined under
  /// all-reduce without mixed precision (the averages are in grad()), and after clear().
  const at::Tensor& partition() const { return partition_; }
  /// Drops the partition (the step consumed it, or skipped).
  void clear() { partition_ = at::Tensor(); }
  /// Bytes of the partition alive.
  int64_t bytes() const { return partition_.defined() ? static_cast<int64_t>(partition_.nbytes()) : 0; }
  /// The freed bucket buffers the pool keeps ([Note: stage 1 buckets]), and releasing them.
  int64_t idle_bytes() const { return pool_.idle_bytes(); }
  void release_idle() { pool_.release_idle(); }

 private:
  comm::CommHandle issue(int b, std::vector<at::Tensor>& params);
  void finish(int b, std::vector<at::Tensor>& params);

  const ZeroLayout& layout_;
  Config config_;
  at::Tensor partition_;
  memory::BufferPool pool_{/*max_idle=*/4, /*min_block_bytes=*/0};
  // The step's buckets in flight: bucket buffers, and reduce-scatter outputs in the
  // communication dtype where the partition's differs.
  std::vector<at::Tensor> buffers_, outs_;
};

}  // namespace fsdp::optim::detail
