#include "zero_bucket_reducer.h"

#include <algorithm>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp/autograd/end_of_backward.h"

namespace fsdp::optim::detail {

namespace {

const char* state_name(int s) {
  static const char* names[] = {"EMPTY", "FILLING", "READY", "REDUCING"};
  return names[s];
}

// Runs after AccumulateGrad has written parameter i's gradient. Holds the reducer
// weakly: a hook left on a parameter after its optimizer died does nothing.
class ZeroGradHook : public torch::autograd::FunctionPostHook {
 public:
  ZeroGradHook(std::weak_ptr<ZeroBucketReducer> reducer, size_t i) : reducer_(std::move(reducer)), i_(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto r = reducer_.lock()) r->on_grad(i_);
    return outputs;
  }

 private:
  std::weak_ptr<ZeroBucketReducer> reducer_;
  size_t i_;
};

}  // namespace

ZeroBucketReducer::ZeroBucketReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                                 const ZeroLayout& layout, Config config)
    : params_(std::move(params)), names_(std::move(names)), layout_(layout), config_(std::move(config)),
      // At most two buckets reducing and one filling; a fourth spares a block when
      // bucket sizes differ.
      pool_(/*max_idle=*/4, /*min_block_bytes=*/0) {
  TORCH_INTERNAL_ASSERT(params_.size() == layout_.params().size() && names_.size() == params_.size());
  pool_.set_block_allocator([g = config_.group](size_t n) { return comm::allocate_collective_buffer(g, n); });
  buckets_.resize(layout_.buckets().size());
  arrived_.assign(params_.size(), 0);
  seen_.assign(params_.size(), 0);
  used_.assign(params_.size(), 0);
}

ZeroBucketReducer::~ZeroBucketReducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i)
    if (accumulators_[i]) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void ZeroBucketReducer::install_hooks() {
  // The AccumulateGrad node is held weakly by its parameter: keep it alive, so the
  // node that carries our hook is the one every backward uses.
  accumulators_.resize(params_.size());
  hook_keys_.resize(params_.size());
  std::weak_ptr<ZeroBucketReducer> self = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_INTERNAL_ASSERT(acc, "no grad accumulator for ", names_[i]);
    hook_keys_[i] = acc->add_post_hook(std::make_unique<ZeroGradHook>(self, i));
    accumulators_[i] = std::move(acc);
  }
}

void ZeroBucketReducer::transition(size_t b, BucketState to, const char* where) {
  Bucket& k = buckets_[b];
  const BucketState from = k.state;
  const bool ok = (from == BucketState::EMPTY && (to == BucketState::FILLING || to == BucketState::READY)) ||
                  (from == BucketState::FILLING && to == BucketState::READY) ||
                  (from == BucketState::READY && to == BucketState::REDUCING) ||
                  (from == BucketState::REDUCING && to == BucketState::EMPTY);
  TORCH_INTERNAL_ASSERT(ok, "ZeroRedundancyOptimizer: bucket ", b, " cannot go from ", state_name(int(from)),
                        " to ", state_name(int(to)), " in ", where);
  k.state = to;
}

void ZeroBucketReducer::ensure_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  std::weak_ptr<ZeroBucketReducer> self = weak_from_this();
  // On the outermost backward: an activation checkpoint's nested backward must not issue
  // the buckets still open.
  autograd::queue_end_of_backward([self] {
    if (auto r = self.lock()) r->finish_backward();
  });
}

void ZeroBucketReducer::on_grad(size_t i) {
  ensure_callback();
  const ZeroParamSlot& slot = layout_.params()[i];
  const size_t b = static_cast<size_t>(slot.bucket);
  Bucket& k = buckets_[b];
  const int rank = config_.group.rank();
  TORCH_CHECK(!seen_[i] && !arrived_[i] && (k.state == BucketState::EMPTY || k.state == BucketState::FILLING),
              "ZeroRedundancyOptimizer (stage 2, rank ", rank, "): parameter '", names_[i],
              "' received a second gradient in one backward (its bucket ", b, " is ",
              state_name(int(k.state)),
              "). Stage 2 reduces each gradient once per backward: a parameter used both inside and "
              "outside an activation checkpoint gets a second one. "
              "Keep the parameter's uses on one side of the checkpoint, or use stage 1");
  at::Tensor& grad = params_[i].mutable_grad();
  TORCH_CHECK(grad.defined() && !grad.is_sparse() && grad.numel() == slot.numel,
              "ZeroRedundancyOptimizer (stage 2, rank ", rank, "): parameter '", names_[i],
              "' has no dense gradient of ", slot.numel, " elements after AccumulateGrad");
  const ZeroBucket& lb = layout_.buckets()[b];
  if (k.state == BucketState::EMPTY) {
    k.buffer = pool_.empty(lb.padded, params_[i].options().dtype(config_.comm_dtype));
    if (lb.padded > lb.numel) k.buffer.narrow(0, lb.numel, lb.padded - lb.numel).zero_();
    transition(b, BucketState::FILLING, "on_grad");
  }
  k.buffer.narrow(0, slot.bucket_offset, slot.numel).copy_(grad.reshape({-1}));
  grad.reset();  // the bucket holds it now
  arrived_[i] = 1;
  seen_[i] = 1;
  used_[i] = 1;
  if (++k.arrived == lb.end_param - lb.first_param) transition(b, BucketState::READY, "on_grad");
  issue_ready();
}

void ZeroBucketReducer::issue_ready() {
  while (next_issue_ < buckets_.size() && buckets_[next_issue_].state == BucketState::READY) issue(next_issue_++);
}

void ZeroBucketReducer::issue(size_t b) {
  Bucket& k = buckets_[b];
  const ZeroBucket& lb = layout_.buckets()[b];
  // Window of reductions in flight: two with overlap, else each completes at once.
  while (!in_flight_.empty() && static_cast<int>(in_flight_.size()) >= 2) {
    complete(in_flight_.front());
    in_flight_.erase(in_flight_.begin());
  }
  if (!partition_.defined())
    partition_ = at::empty({layout_.partition_numel()}, k.buffer.options().dtype(config_.grad_dtype));
  at::Tensor slice = partition_.narrow(0, lb.local_offset, lb.chunk);
  k.out = (!k.accumulated && config_.comm_dtype == config_.grad_dtype) ? slice
                                                                        : at::empty({lb.chunk}, k.buffer.options());
  transition(b, BucketState::REDUCING, "issue");
  if (lb.padded > 0)
    k.handle = comm::reduce_scatter(config_.group, k.out, k.buffer, comm::ReduceOp::Avg,
                                    {comm::Phase::Backward, "bucket " + std::to_string(b)});
  if (config_.overlap) {
    in_flight_.push_back(b);
  } else {
    complete(b);
  }
}

void ZeroBucketReducer::complete(size_t b) {
  Bucket& k = buckets_[b];
  const ZeroBucket& lb = layout_.buckets()[b];
  if (k.handle.defined()) k.handle.wait();
  at::Tensor slice = partition_.narrow(0, lb.local_offset, lb.chunk);
  if (!k.out.is_same(slice)) {
    if (k.accumulated) slice.add_(k.out);
    else slice.copy_(k.out);
  }
  k.accumulated = true;
  k.out = at::Tensor();
  k.buffer = at::Tensor();
  k.handle = comm::CommHandle();
  k.arrived = 0;
  for (int i = lb.first_param; i < lb.end_param; ++i) arrived_[i] = 0;
  transition(b, BucketState::EMPTY, "complete");
  if (on_reduced_) on_reduced_(b);
}

void ZeroBucketReducer::consume(size_t b) {
  const ZeroBucket& lb = layout_.buckets()[b];
  buckets_[b].accumulated = false;
  for (int i = lb.first_param; i < lb.end_param; ++i) used_[i] = 0;
}

void ZeroBucketReducer::finish_backward() {
  // Buckets not issued yet, in order: parameters that got no gradient here count as zeros.
  for (size_t b = next_issue_; b < buckets_.size(); ++b) {
    Bucket& k = buckets_[b];
    const ZeroBucket& lb = layout_.buckets()[b];
    if (k.state == BucketState::EMPTY) {
      k.buffer = pool_.empty(lb.padded, params_[lb.first_param].options().dtype(config_.comm_dtype)).zero_();
    } else if (k.state == BucketState::FILLING) {
      const auto& slots = layout_.params();
      for (int i = lb.first_param; i < lb.end_param; ++i)
        if (!arrived_[i]) k.buffer.narrow(0, slots[i].bucket_offset, slots[i].numel).zero_();
    }
    if (k.state != BucketState::READY) transition(b, BucketState::READY, "finish_backward");
  }
  issue_ready();
  for (size_t b : in_flight_) complete(b);
  in_flight_.clear();
  next_issue_ = 0;
  std::fill(seen_.begin(), seen_.end(), 0);
  callback_queued_ = false;
}

void ZeroBucketReducer::clear() {
  TORCH_INTERNAL_ASSERT(!callback_queued_ && in_flight_.empty());
  partition_ = at::Tensor();
  for (auto& k : buckets_) k.accumulated = false;
  std::fill(used_.begin(), used_.end(), 0);
}

void ZeroBucketReducer::zero() {
  TORCH_INTERNAL_ASSERT(!callback_queued_ && in_flight_.empty());
  if (partition_.defined()) partition_.zero_();
}

int64_t ZeroBucketReducer::bytes() const {
  int64_t n = partition_.defined() ? partition_.nbytes() : 0;
  for (const auto& k : buckets_) {
    if (k.buffer.defined()) n += k.buffer.nbytes();
    if (k.out.defined() && !(partition_.defined() && k.out.is_alias_of(partition_)))
      n += k.out.nbytes();
  }
  return n;
}

}  // namespace fsdp::optim::detail
