// ZeroRedundancyOptimizer's step, inside: reduce, the pieces' gradients, the agreement of
// every rank, unscale/clip or skip, the inner step; the buckets stepped inside backward
// (optimizer_in_backward); placement after the first step (gpu_margin_mem_ratio).
#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "engine/host_step_queue.h"
#include "engine/placement.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/memory/optimizer_state_bytes.h"
#include "memory/host_options.h"
#include "memory/param_state_key.h"
#include "zero_optimizer_impl.h"

namespace fsdp::optim {

/// Which parameters have a gradient on this rank (1 or 0, flat order); stage 1 reduces
/// now, stage 2 completes its backward's reductions.
std::vector<double> ZeroRedundancyOptimizer::Impl::reduce_gradients() {
  std::vector<double> used(params.size(), 0.0);
  if (stage2()) {
    if (reducer->in_backward()) reducer->finish_backward();
    for (size_t i = 0; i < params.size(); ++i) used[i] = reducer->used()[i];
    return used;
  }
  for (size_t i = 0; i < params.size(); ++i) used[i] = params[i].grad().defined();
  stage1->reduce(params);
  return used;
}

/// Each piece's gradient: a view of the reduced gradients (of their host copy where the
/// piece is on the host under cpu_offload).
void ZeroRedundancyOptimizer::Impl::attach_piece_gradients() {
  size_t source_bucket = SIZE_MAX;
  const at::Tensor* reduced = nullptr;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ZeroPiece& pc = pieces[k];
    at::Tensor g;
    if (grads_in_params()) {
      const at::Tensor& full = params[pc.param].grad();
      if (full.defined()) g = full.view({-1}).narrow(0, pc.param_offset, pc.numel);
    } else {
      if (bucket_of(pc) != source_bucket) {  // pieces are in flat order: one source per bucket
        source_bucket = bucket_of(pc);
        reduced = &gradient_source(source_bucket);
      }
      if (reduced->defined()) g = reduced->narrow(0, pc.local_offset, pc.numel);
    }
    piece_tensors[k].mutable_grad() = g;
  }
}

/// The partition bucket b's pieces take their gradients from: the reduced partition itself,
/// or where the bucket is on the host its host copy, into which b's chunk is copied now (the
/// optimizer steps host tensors with host gradients; `async`: a copy from a GPU returns at
/// once, and an event after it says when it has landed). Undefined when nothing was reduced.
const at::Tensor& ZeroRedundancyOptimizer::Impl::gradient_source(size_t b, bool async) {
  const at::Tensor& reduced = partition();
  if (!on_host(b) || !reduced.defined()) return reduced;
  if (!host_grads.defined())
    host_grads = at::empty({layout->partition_numel()}, memory::host_options(reduced.options()));
  const auto& lb = layout->buckets()[b];
  host_grads.narrow(0, lb.local_offset, lb.chunk).copy_(reduced.narrow(0, lb.local_offset, lb.chunk), async);
  return host_grads;
}


/// Bytes of the optimizer state of piece k (0 before its first step).
int64_t ZeroRedundancyOptimizer::Impl::state_bytes(size_t k) const {
  const auto* state = memory::param_state(*inner, piece_tensors[k]);
  return state ? memory::optimizer_state_bytes(*state) : 0;
}

int64_t ZeroRedundancyOptimizer::Impl::host_state_bytes() const {
  int64_t total = 0;
  for (size_t k = 0; k < pieces.size(); ++k)
    if (on_host(bucket_of(pieces[k]))) total += state_bytes(k);
  return total;
}

/// gpu_margin_mem_ratio, after the first step: the buckets whose masters and state fit in
/// the margin move to the device ([Note: auto placement]). Once.
void ZeroRedundancyOptimizer::Impl::place_after_warmup() {
  if (placed || options.gpu_margin_mem_ratio() == 0) return;
  placed = true;
  std::vector<engine::OffloadedPiece> buckets(layout->buckets().size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    engine::OffloadedPiece& b = buckets[bucket_of(pieces[k])];
    b.tensor_bytes += static_cast<int64_t>(piece_tensors[k].nbytes());
    b.state_params.push_back(piece_tensors[k]);
  }
  engine::place_on_device(buckets, *inner, flat.device(), options.gpu_margin_mem_ratio(),
                          [this](size_t b) { move_bucket_to_device(b); });
}

/// Bucket b's masters to a chunk on the device, which its pieces then view (their
/// TensorImpls, and so the optimizer's keys, stay; placement moved their state).
void ZeroRedundancyOptimizer::Impl::move_bucket_to_device(size_t b) {
  const auto& lb = layout->buckets()[b];
  at::Tensor chunk = at::empty({lb.chunk}, master.options().device(flat.device()));
  chunk.copy_(master.narrow(0, lb.local_offset, lb.chunk));
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ZeroPiece& pc = pieces[k];
    if (bucket_of(pc) == b) piece_tensors[k].set_data(chunk.narrow(0, pc.local_offset - lb.local_offset, pc.numel));
  }
  device_masters[b] = chunk;
}

/// Multiplies the gradients the step uses by `factor` (unscaling, clipping).
void ZeroRedundancyOptimizer::Impl::scale_gradients(double factor) {
  if (grads_in_params()) {
    // Every rank holds the same full gradients: scale them all, so grad() stays consistent.
    for (auto& p : params)
      if (p.grad().defined()) p.mutable_grad().mul_(factor);
  } else {
    for (auto& t : piece_tensors)
      if (t.grad().defined()) t.mutable_grad().mul_(factor);
  }
}

/// One all-reduce tells every rank which parameters have a gradient anywhere (the others
/// are skipped, as torch::optim skips a parameter whose grad is undefined), the global
/// squared norm (pieces never overlap and leave out the padding, so every element counts
/// once) and whether any rank saw inf/nan.
StepAgreement ZeroRedundancyOptimizer::Impl::agree(std::vector<double> used) {
  const size_t nparams = params.size();
  const bool need_norm = options.clip_grad_norm() > 0 || scaler;
  double squared = 0, found_nonfinite = 0;
  if (need_norm) {
    for (auto& t : piece_tensors) {
      if (!t.grad().defined()) continue;
      const double norm = t.grad().norm().item<double>();  // fp32 per tensor, as clip_grad_norm_
      if (!std::isfinite(norm)) found_nonfinite = 1;
      else squared += norm * norm;
    }
  }
  used.push_back(squared);
  used.push_back(found_nonfinite);
  at::Tensor summed = torch::tensor(used, at::TensorOptions().dtype(at::kDouble));
  if (pg.size() > 1) comm::all_reduce(pg, summed, comm::ReduceOp::kSum, {comm::Phase::kStep, "agreement"}).wait();
  auto a = summed.accessor<double, 1>();
  StepAgreement agreed;
  agreed.used.assign(a.data(), a.data() + nparams);
  agreed.norm = need_norm ? std::sqrt(a[nparams]) : -1;
  agreed.overflow = scaler && a[nparams + 1] > 0;
  return agreed;
}

/// Parameters without a gradient on any rank keep none (and are not stepped).
void ZeroRedundancyOptimizer::Impl::drop_unused(const StepAgreement& agreed) {
  for (size_t k = 0; k < pieces.size(); ++k)
    if (agreed.used[pieces[k].param] == 0) piece_tensors[k].mutable_grad().reset();
  if (all_reduce_variant())
    for (size_t i = 0; i < params.size(); ++i)
      if (agreed.used[i] == 0) params[i].mutable_grad().reset();  // unused everywhere: stays undefined
}

/// A skipped step's gradients go (the parameters' own with zero_grad).
void ZeroRedundancyOptimizer::Impl::discard_gradients() {
  for (auto& t : piece_tensors) t.mutable_grad().reset();
  if (stage1) stage1->clear();
}

/// Hyperparameters down (an LR scheduler may have changed ours), then the inner step;
/// the reduced gradients are consumed.
void ZeroRedundancyOptimizer::Impl::inner_step(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  auto& inner_groups = inner->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) inner_groups[g].set_options(groups[g].options().clone());
  inner->step();
  for (auto& t : piece_tensors) t.mutable_grad().reset();
  if (stage2()) reducer->clear();
  else stage1->clear();
}

bool ZeroRedundancyOptimizer::Impl::stepped_any() const {
  return std::find(stepped.begin(), stepped.end(), 1) != stepped.end();
}

/// Which of the bucket's parameters have a gradient on some rank (step()'s agreement, for
/// one bucket); every rank completes its buckets in the same order, so these all-reduces match.
std::vector<double> ZeroRedundancyOptimizer::Impl::agree_used_in_bucket(const detail::ZeroBucket& lb) {
  std::vector<double> used(reducer->used().begin() + lb.first_param, reducer->used().begin() + lb.end_param);
  if (pg.size() == 1 || used.empty()) return used;
  at::Tensor summed = torch::tensor(used, at::TensorOptions().dtype(at::kDouble));
  comm::all_reduce(pg, summed, comm::ReduceOp::kSum, {comm::Phase::kBackward, "bucket used"}).wait();
  auto a = summed.accessor<double, 1>();
  return std::vector<double>(a.data(), a.data() + used.size());
}

/// ZeroOptions::optimizer_in_backward: bucket b's chunk is complete; its pieces are
/// stepped as step() would step them (the parameters used nowhere skipped), then the
/// chunk is consumed. Only this bucket's pieces have a gradient during the step.
void ZeroRedundancyOptimizer::Impl::step_bucket(size_t b,
                                                const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  if (no_step) return;
  TORCH_CHECK(!stepped[b], "ZeroRedundancyOptimizer (rank ", rank(), "): a second backward would step bucket ", b,
              " before step() all-gathered the parameters the first one stepped; under optimizer_in_backward call "
              "step() after every backward, and wrap the micro-batches but the last of an accumulation in no_step()");
  torch::NoGradGuard no_grad;
  const detail::ZeroBucket& lb = layout->buckets()[b];
  const std::vector<double> used = agree_used_in_bucket(lb);
  std::vector<size_t> mine;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ZeroPiece& pc = pieces[k];
    if (pc.param >= lb.first_param && pc.param < lb.end_param && used[pc.param - lb.first_param] != 0)
      mine.push_back(k);
  }
  const bool on_thread = steps->on_host_thread() && on_host(b);
  at::Tensor reduced = gradient_source(b, /*async=*/on_thread);
  std::shared_ptr<c10::Event> landed =
      on_thread && reduced.defined() ? engine::event_after_queued_work(partition().device()) : nullptr;
  auto step = [this, mine, reduced, landed, groups = &groups] {
    if (landed) landed->synchronize();
    for (size_t k : mine) piece_tensors[k].mutable_grad() = reduced.narrow(0, pieces[k].local_offset, pieces[k].numel);
    auto& inner_groups = inner->param_groups();
    for (size_t g = 0; g < groups->size(); ++g) inner_groups[g].set_options((*groups)[g].options().clone());
    inner->step();
    for (size_t k : mine) piece_tensors[k].mutable_grad().reset();
  };
  steps->run(std::move(step), on_host(b));
  reducer->consume(b);
  stepped[b] = 1;
}

}  // namespace fsdp::optim
