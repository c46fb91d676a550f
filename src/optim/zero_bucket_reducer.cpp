#include "zero_bucket_reducer.h"

#include <algorithm>
#include <optional>
#include <utility>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp/autograd/end_of_backward.h"

namespace fsdp::optim::detail {

namespace {

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

// The layout's buckets as FixedBuckets sees them: members are the parameters, in flat order.
engine::FixedBuckets fixed_buckets(const ZeroLayout& layout, const comm::ProcessGroup& group) {
  std::vector<engine::FixedBuckets::Member> members;
  for (const ZeroParamSlot& p : layout.params()) members.push_back({p.bucket, p.bucket_offset, p.numel});
  std::vector<engine::FixedBuckets::Shape> shapes;
  for (const ZeroBucket& b : layout.buckets()) shapes.push_back({b.first_param, b.end_param, b.numel, b.padded});
  // At most two buckets reducing and one filling; a fourth spares a block when bucket sizes differ.
  return engine::FixedBuckets(std::move(members), std::move(shapes), /*max_idle=*/4,
                              [group](size_t n) { return comm::allocate_collective_buffer(group, n); });
}

}  // namespace

// One bucket's reduce-scatter in flight, and where its chunk lands: a slice of the partition,
// or a temporary added to it (an accumulation, or another dtype).
class ZeroBucketReducer::Reduction : public engine::ReductionWindow::Reduction {
 public:
  Reduction(ZeroBucketReducer& owner, size_t bucket, at::Tensor out, comm::CommHandle handle)
      : owner_(owner), bucket_(bucket), out_(std::move(out)), handle_(std::move(handle)) {}
  bool landed() const override { return !handle_.defined() || handle_.is_completed(); }
  void complete() override {
    handle_.wait();
    owner_.complete(bucket_, out_);
  }
  int64_t held_bytes() const override {
    const at::Tensor& p = owner_.partition_;
    return out_.defined() && !(p.defined() && out_.is_alias_of(p)) ? static_cast<int64_t>(out_.nbytes()) : 0;
  }

 private:
  ZeroBucketReducer& owner_;
  size_t bucket_;
  at::Tensor out_;
  comm::CommHandle handle_;
};

ZeroBucketReducer::ZeroBucketReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                                 const ZeroLayout& layout, Config config)
    : params_(std::move(params)), names_(std::move(names)), layout_(layout), config_(std::move(config)),
      buckets_(fixed_buckets(layout_, config_.group)),
      // Two reductions in flight with overlap; without it each completes as it is issued.
      in_flight_(config_.overlap ? 2 : 1) {
  TORCH_INTERNAL_ASSERT(params_.size() == layout_.params().size() && names_.size() == params_.size());
  accumulated_.assign(layout_.buckets().size(), 0);
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
  const engine::FixedBuckets::State state = buckets_.state(b);
  const int rank = config_.group.rank();
  TORCH_CHECK(!seen_[i] && !buckets_.arrived(i) &&
                  (state == engine::FixedBuckets::State::kEmpty || state == engine::FixedBuckets::State::kFilling),
              "ZeroRedundancyOptimizer (stage 2, rank ", rank, "): parameter '", names_[i],
              "' received a second gradient in one backward (its bucket ", b, " is ", engine::to_string(state),
              "). Stage 2 reduces each gradient once per backward: a parameter used both inside and "
              "outside an activation checkpoint gets a second one. "
              "Keep the parameter's uses on one side of the checkpoint, or use stage 1");
  at::Tensor& grad = params_[i].mutable_grad();
  TORCH_CHECK(grad.defined() && !grad.is_sparse() && grad.numel() == slot.numel,
              "ZeroRedundancyOptimizer (stage 2, rank ", rank, "): parameter '", names_[i],
              "' has no dense gradient of ", slot.numel, " elements after AccumulateGrad");
  buckets_.arrive(i, grad, params_[i].options().dtype(config_.comm_dtype));
  grad.reset();  // the bucket holds it now
  seen_[i] = 1;
  used_[i] = 1;
  issue_ready();
}

void ZeroBucketReducer::issue_ready() {
  while (const std::optional<size_t> b = buckets_.next_ready()) issue(*b);
}

void ZeroBucketReducer::issue(size_t b) {
  const ZeroBucket& lb = layout_.buckets()[b];
  const at::Tensor& buffer = buckets_.buffer(b);
  in_flight_.make_room();
  if (!partition_.defined())
    partition_ = at::empty({layout_.partition_numel()}, buffer.options().dtype(config_.grad_dtype));
  at::Tensor slice = partition_.narrow(0, lb.local_offset, lb.chunk);
  at::Tensor out = (!accumulated_[b] && config_.comm_dtype == config_.grad_dtype) ? slice
                                                                                    : at::empty({lb.chunk}, buffer.options());
  comm::CommHandle handle;
  if (lb.padded > 0)
    handle = comm::reduce_scatter(config_.group, out, buffer, comm::ReduceOp::kAvg,
                                  {comm::Phase::kBackward, "bucket " + std::to_string(b)});
  in_flight_.push(std::make_unique<Reduction>(*this, b, std::move(out), std::move(handle)));
  if (!config_.overlap) in_flight_.complete_all();
}

void ZeroBucketReducer::complete(size_t b, at::Tensor& out) {
  const ZeroBucket& lb = layout_.buckets()[b];
  at::Tensor slice = partition_.narrow(0, lb.local_offset, lb.chunk);
  if (!out.is_same(slice)) {
    if (accumulated_[b]) slice.add_(out);
    else slice.copy_(out);
  }
  accumulated_[b] = 1;
  out = at::Tensor();
  buckets_.reduced(b);
  if (on_reduced_) on_reduced_(b);
}

void ZeroBucketReducer::consume(size_t b) {
  const ZeroBucket& lb = layout_.buckets()[b];
  accumulated_[b] = 0;
  for (int i = lb.first_param; i < lb.end_param; ++i) used_[i] = 0;
}

void ZeroBucketReducer::finish_backward() {
  // Buckets not issued yet, in order: parameters that got no gradient here count as zeros.
  if (!params_.empty()) buckets_.fill_rest(params_.front().options().dtype(config_.comm_dtype));
  issue_ready();
  in_flight_.complete_all();
  buckets_.restart();
  std::fill(seen_.begin(), seen_.end(), 0);
  callback_queued_ = false;
}

void ZeroBucketReducer::clear() {
  TORCH_INTERNAL_ASSERT(!callback_queued_ && in_flight_.empty());
  partition_ = at::Tensor();
  std::fill(accumulated_.begin(), accumulated_.end(), 0);
  std::fill(used_.begin(), used_.end(), 0);
}

void ZeroBucketReducer::zero() {
  TORCH_INTERNAL_ASSERT(!callback_queued_ && in_flight_.empty());
  if (partition_.defined()) partition_.zero_();
}

int64_t ZeroBucketReducer::bytes() const {
  const int64_t partition = partition_.defined() ? static_cast<int64_t>(partition_.nbytes()) : 0;
  return partition + buckets_.bytes() + in_flight_.held_bytes();
}

}  // namespace fsdp::optim::detail
