#include "zero_stage1_reducer.h"

#include "memory/storage_alias.h"
#include "fsdp/comm/collectives.h"
#include "engine/reduction_window.h"

namespace fsdp::optim::detail {

ZeroStage1Reducer::ZeroStage1Reducer(const ZeroLayout& layout, Config config)
    : layout_(layout), config_(std::move(config)) {
  pool_.set_block_allocator([g = config_.group](size_t n) { return comm::allocate_collective_buffer(g, n); });
}

void ZeroStage1Reducer::reduce(std::vector<at::Tensor>& params) {
  const int nbuckets = static_cast<int>(layout_.buckets().size());
  buffers_.assign(nbuckets, at::Tensor());
  outs_.assign(nbuckets, at::Tensor());
  if (!config_.all_reduce || config_.mixed) partition_ = at::empty({layout_.partition_numel()}, config_.grad_options);
  engine::for_each_bucket(
      nbuckets, config_.window, [&](int b) { return issue(b, params); }, [&](int b) { finish(b, params); });
  buffers_.clear();
  outs_.clear();
}

/// Fills bucket b from the gradients and issues its reduction.
comm::CommHandle ZeroStage1Reducer::issue(int b, std::vector<at::Tensor>& params) {
  const auto& lb = layout_.buckets()[b];
  if (lb.padded == 0) return comm::CommHandle();
  at::Tensor buf = pool_.empty(lb.padded, config_.comm_options);  // [Note: stage 1 buckets]
  if (lb.padded > lb.numel) buf.narrow(0, lb.numel, lb.padded - lb.numel).zero_();
  for (int i = lb.first_param; i < lb.end_param; ++i) {
    const auto& slot = layout_.params()[i];
    at::Tensor dst = buf.narrow(0, slot.bucket_offset, slot.numel);
    const at::Tensor& g = params[i].grad();
    if (g.defined()) dst.copy_(g.reshape({-1}));
    else dst.zero_();
  }
  buffers_[b] = buf;
  const comm::CallLabel label(comm::Phase::kStep, "bucket " + std::to_string(b));
  if (config_.all_reduce) return comm::all_reduce(config_.group, buf, comm::ReduceOp::kAvg, label);
  at::Tensor slice = partition_.narrow(0, lb.local_offset, lb.chunk);
  if (slice.scalar_type() == buf.scalar_type())
    return comm::reduce_scatter(config_.group, slice, buf, comm::ReduceOp::kAvg, label);
  // Reduced in the communication dtype, widened into the partition by finish().
  outs_[b] = at::empty({lb.chunk}, config_.comm_options);
  return comm::reduce_scatter(config_.group, outs_[b], buf, comm::ReduceOp::kAvg, label);
}

/// Bucket b's reduction completed: its averages into grad() (all-reduce) and the partition.
void ZeroStage1Reducer::finish(int b, std::vector<at::Tensor>& params) {
  const auto& lb = layout_.buckets()[b];
  if (config_.all_reduce && buffers_[b].defined()) {
    for (int i = lb.first_param; i < lb.end_param; ++i) {
      const auto& slot = layout_.params()[i];
      at::Tensor& g = params[i].mutable_grad();
      at::Tensor reduced = buffers_[b].narrow(0, slot.bucket_offset, slot.numel).view(params[i].sizes());
      if (reduced.scalar_type() == params[i].scalar_type()) {
        // The gradient becomes its part of the reduced bucket, as under DDP's
        // gradient_as_bucket_view: no pass copying the bucket back (the step is bound
        // by passes over memory), and the gradient it replaces is freed. Contiguous, so
        // the pieces are views of grad().
        g = memory::storage_alias(reduced);
        continue;
      }
      // Contiguous, so that the pieces are views of grad().
      if (!g.defined() || !g.is_contiguous()) g = at::empty_like(params[i], at::MemoryFormat::Contiguous);
      g.copy_(reduced);
    }
    if (config_.mixed)
      partition_.narrow(0, lb.local_offset, lb.chunk)
          .copy_(buffers_[b].narrow(0, static_cast<int64_t>(config_.group.rank()) * lb.chunk, lb.chunk));
  } else if (outs_[b].defined()) {
    partition_.narrow(0, lb.local_offset, lb.chunk).copy_(outs_[b]);
  }
  buffers_[b] = at::Tensor();
  outs_[b] = at::Tensor();
}

}  // namespace fsdp::optim::detail
