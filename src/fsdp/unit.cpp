#include "unit.h"

#include <sstream>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "runtime.h"

namespace fsdp::detail {

const char* to_string(UnitState s) {
  switch (s) {
    case UnitState::IDLE: return "IDLE";
    case UnitState::FORWARD: return "FORWARD";
    case UnitState::AWAIT_BACKWARD: return "AWAIT_BACKWARD";
    case UnitState::BACKWARD: return "BACKWARD";
    case UnitState::REDUCING: return "REDUCING";
  }
  return "?";
}

namespace {

// Runs after AccumulateGrad has written a parameter's (full-shape) gradient.
class ParamGradHook : public torch::autograd::FunctionPostHook {
 public:
  ParamGradHook(Unit* unit, size_t entry) : unit_(unit), entry_(entry) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    unit_->on_param_grad(entry_);
    return outputs;
  }

 private:
  Unit* unit_;
  size_t entry_;
};

// A tensor on the same memory as `view` that autograd does not know as a view:
// optimizers call grad.detach_() in zero_grad, which views refuse. Gradient
// pieces share the reduced shard's memory this way, with no copy.
at::Tensor storage_alias(const at::Tensor& view) {
  at::NoGradGuard no_grad;
  return at::empty({0}, view.options()).set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
}

}  // namespace

Unit::Unit(Runtime* runtime, int index, std::string path, std::unique_ptr<FlatParameter> flat,
           bool is_root, bool reshard_after_forward)
    : runtime_(runtime), index_(index), path_(std::move(path)), flat_(std::move(flat)),
      is_root_(is_root), reshard_after_forward_(reshard_after_forward && flat_->sharded()) {
  const auto& entries = flat_->entries();
  fired_flags_.assign(entries.size(), false);
  stashed_grads_.resize(entries.size());
  accumulators_.resize(entries.size());
  for (const auto& e : entries) {
    if (e.param.requires_grad()) ++num_grad_params_;
    else has_frozen_params_ = true;
  }
}

void Unit::expect_state(std::initializer_list<UnitState> allowed, const char* where) const {
  for (auto s : allowed)
    if (s == state_) return;
  std::ostringstream os;
  for (auto s : allowed) os << (os.tellp() ? "|" : "") << to_string(s);
  TORCH_CHECK(false, "fsdp: unit '", path_.empty() ? "<root>" : path_, "' on rank ",
              runtime_->group().rank(), ": ", where, " in state ", to_string(state_),
              ", expected ", os.str(),
              ". Was forward called twice without backward inside one unit, or a module "
              "called from another thread?");
}

bool Unit::needs_backward_gather() const {
  return flat_->separate_unsharded() && !flat_->unsharded_allocated();
}

void Unit::gather() {
  issue_gather();
  wait_gather();
}

// ---- asynchronous gathers and their trace spans ([Note: prefetch] in runtime.h) ----

std::string Unit::trace_name(const char* what) const { return std::string(what) + " " + label(); }

void Unit::issue_gather() {
  if (!flat_->separate_unsharded() || flat_->unsharded_allocated()) return;
  flat_->alloc_unsharded(runtime_->pool());
  if (flat_->sharded()) {
    // Cast before the gather: param_dtype bytes move ([Note: mixed precision]).
    // The cast copy must live until the gather completes (wait_gather).
    gather_source_ = flat_->shard_for_gather();
    gather_mark_ = runtime_->tracer().begin();
    gather_handle_ = dist::all_gather_into(runtime_->gather_group(), flat_->unsharded(), gather_source_);
    gather_pending_ = true;
  } else {
    at::NoGradGuard no_grad;  // NO_SHARD with param_dtype: a local low-precision copy
    flat_->unsharded().copy_(flat_->shard());
  }
  runtime_->note_transient_bytes();
}

void Unit::wait_gather() {
  if (!gather_pending_) return;
  gather_pending_ = false;
  gather_handle_.wait();
  gather_handle_ = dist::CommHandle();
  gather_source_ = at::Tensor();
  runtime_->tracer().end(trace_name("all_gather"), Tracer::kGather, gather_mark_);
}

void Unit::free_unsharded() {
  wait_gather();  // never free a buffer a collective is still writing into
  flat_->free_unsharded();
}

void Unit::enter_backward() {
  if (state_ == UnitState::AWAIT_BACKWARD) state_ = UnitState::BACKWARD;
}

void Unit::unshard() {
  gather();
  if (flat_->state() != FlatState::Unsharded) flat_->use_unsharded_views();
}

void Unit::ensure_grad_accumulators() {
  // The AccumulateGrad node records the parameter's shape when it is created, so
  // it must be created while the parameter has its full shape (here), and kept
  // alive by us so the same node, with our hook, is used in every iteration.
  // Under mixed precision set_data changed the parameter's dtype, which drops
  // the node we hold from the parameter: re-acquire it (see [Note: mixed
  // precision] in flat_param.h); the old node and its hook are released here.
  auto& entries = flat_->entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!entries[i].param.requires_grad()) continue;
    if (accumulators_[i] &&
        torch::autograd::impl::try_get_grad_accumulator(entries[i].param) == accumulators_[i])
      continue;
    auto acc = torch::autograd::impl::grad_accumulator(entries[i].param);
    TORCH_INTERNAL_ASSERT(acc, "no grad accumulator for ", entries[i].fqn);
    acc->add_post_hook(std::make_unique<ParamGradHook>(this, i));
    accumulators_[i] = std::move(acc);
  }
}

void Unit::pre_forward() {
  runtime_->on_unit_pre_forward(this);
  const bool training = at::GradMode::is_enabled();
  // A unit can run forward more than once per iteration (a module called twice).
  expect_state({UnitState::IDLE, UnitState::AWAIT_BACKWARD, UnitState::FORWARD}, "pre_forward");
  // Gradient pieces from earlier backward passes stay on the parameters until
  // backward starts (stash_grads), so that the user can still zero or read them.
  unshard();
  if (training) ensure_grad_accumulators();
  state_ = UnitState::FORWARD;
  runtime_->prefetch_forward(this);
  if (!forward_mark_.open()) forward_mark_ = runtime_->tracer().begin();
}

void Unit::post_forward(const std::vector<at::Tensor>& outputs) {
  expect_state({UnitState::FORWARD}, "post_forward");
  runtime_->tracer().end(trace_name("forward"), Tracer::kCompute, forward_mark_);
  runtime_->on_unit_post_forward(this);
  if (!at::GradMode::is_enabled()) {
    // Evaluation: no backward follows, so return to the sharded state now.
    // The root stays unsharded until the whole forward is done (root_post_forward).
    if (!is_root_) reset_after_abandoned_forward();
    return;
  }
  state_ = UnitState::AWAIT_BACKWARD;
  if (reshard_after_forward_ && !is_root_ && !runtime_->keeps_gathered_after_forward(this)) {
    free_unsharded();  // views stay; backward re-gathers into the same storage
  }
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    Unit* self = this;
    // register_hook on a copy registers on the same TensorImpl.
    at::Tensor t = out;
    t.register_hook([self](const at::Tensor& grad) {
      self->on_output_grad();
      return grad;
    });
  }
}

std::optional<at::ScalarType> Unit::forward_input_dtype() const {
  if (!flat_->low_precision() || !runtime_->options().mixed_precision().cast_forward_inputs())
    return std::nullopt;
  return flat_->compute_dtype();
}

void Unit::stash_grads() {
  // Gradient pieces from earlier backward passes (accumulation without no_sync)
  // cannot stay on parameters that now have their full shape: AccumulateGrad
  // would add the full gradient to the piece. They are moved aside when this
  // iteration's backward starts and added back to the new pieces at its end.
  // Not at forward: between forward and backward the pieces are the user's
  // (forward -> zero_grad -> backward is a common order; stashing at forward
  // hid them from zero_grad and added the old gradients back after backward).
  if (stashed_) return;
  if (state_ != UnitState::AWAIT_BACKWARD && state_ != UnitState::BACKWARD) return;
  auto& entries = flat_->entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    auto& g = entries[i].param.mutable_grad();
    stashed_grads_[i] = g;
    g = at::Tensor();
  }
  stashed_ = true;
}

void Unit::on_output_grad() {
  runtime_->ensure_final_callback();
  stash_grads();
  // The first output hook of this iteration; a unit gathered ahead (by the
  // backward order or a prefetch) is already in BACKWARD and still comes here,
  // so that it waits for its gather and prefetches the next one.
  if (output_grad_seen_) return;
  if (state_ != UnitState::AWAIT_BACKWARD && state_ != UnitState::BACKWARD) return;
  output_grad_seen_ = true;
  runtime_->on_unit_output_grad(this);
  backward_mark_ = runtime_->tracer().begin();
}

void Unit::on_param_grad(size_t entry) {
  runtime_->ensure_final_callback();
  if (fired_flags_[entry]) return;
  fired_flags_[entry] = true;
  ++fired_;
  if (grads_complete()) {
    runtime_->tracer().end(trace_name("backward"), Tracer::kCompute, backward_mark_);
    runtime_->on_unit_grads_complete(this);
  }
}

bool Unit::flatten_grads(bool no_sync) {
  expect_state({UnitState::AWAIT_BACKWARD, UnitState::BACKWARD}, "flatten_grads");
  // A unit whose parameters are all frozen has nothing to reduce, but its
  // backward may not have run yet (its parameters still feed the input
  // gradient). It stays in AWAIT_BACKWARD/BACKWARD so that its output hook still
  // re-gathers it; finish_iteration reshards it. (Moving it to REDUCING here made
  // its backward read freed storage under FULL_SHARD.)
  if (!has_grad_params()) return false;
  state_ = UnitState::REDUCING;
  auto& entries = flat_->entries();
  // Parameters are no longer needed by this unit's backward: every node that
  // reads them also produced their gradients. Frozen parameters may still be read
  // by later nodes, so such units reshard at the end of backward instead.
  // Freed before the flat gradient is allocated, so that the gradient reuses the
  // parameters' block ([Note: buffer pool]).
  if (flat_->separate_unsharded() && !has_frozen_params_ && !is_root_) free_unsharded();
  // Reduced in reduce_dtype ([Note: mixed precision]); copy_ casts. Every element
  // is written once: gradients are copied in, gradients that were never produced
  // (unused or frozen parameters) and the padding are zeros.
  flat_grad_ = runtime_->pool().empty(flat_->padded_numel(), flat_->options().dtype(flat_->reduce_dtype()));
  for (size_t i = 0; i < entries.size(); ++i) {
    auto& g = entries[i].param.mutable_grad();
    auto dst = flat_->view_of(flat_grad_, i);
    if (g.defined()) {
      dst.copy_(g);
      g = at::Tensor();  // the full gradient is freed here
    } else {
      dst.zero_();
    }
  }
  if (flat_->padded_numel() > flat_->total_numel())
    flat_grad_.narrow(0, flat_->total_numel(), flat_->padded_numel() - flat_->total_numel()).zero_();
  if (no_sync_grad_.defined()) {
    flat_grad_.add_(no_sync_grad_);
    no_sync_grad_ = at::Tensor();
  }
  runtime_->note_transient_bytes();
  if (no_sync) {
    no_sync_grad_ = std::move(flat_grad_);
    flat_grad_ = at::Tensor();
    return false;
  }
  if (runtime_->predivide() != 1) flat_grad_.div_(runtime_->predivide());
  return true;
}

at::Tensor Unit::take_flat_grad() {
  at::Tensor g = std::move(flat_grad_);
  flat_grad_ = at::Tensor();
  return g;
}

void Unit::adopt_reduced_shard(at::Tensor shard) {
  TORCH_INTERNAL_ASSERT(state_ == UnitState::REDUCING && !reduced_ready_, "unit '", label(),
                        "' got a reduced shard in state ", to_string(state_));
  reduced_shard_ = std::move(shard);
  if (runtime_->postdivide() != 1) reduced_shard_.div_(runtime_->postdivide());
  // Gradient pieces in the optimizer's dtype (fp32 master) unless asked otherwise.
  if (reduced_shard_.scalar_type() != flat_->grad_dtype()) reduced_shard_ = reduced_shard_.to(flat_->grad_dtype());
  reduced_ready_ = true;
}

void Unit::finish_iteration() {
  auto& entries = flat_->entries();
  TORCH_INTERNAL_ASSERT(!flat_grad_.defined(), "unit '", label(), "' finishes with an unreduced flat gradient");
  if (reduced_ready_) {
    reduced_ready_ = false;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (!entries[i].param.requires_grad()) continue;
      at::Tensor piece = storage_alias(flat_->piece_of(reduced_shard_, i));
      if (stashed_grads_[i].defined()) piece.add_(stashed_grads_[i].view(piece.sizes()));
      entries[i].param.mutable_grad() = piece;
    }
  } else {
    // No reduction this iteration (no_sync, or no gradient parameters):
    // previous gradient pieces come back unchanged.
    for (size_t i = 0; i < entries.size(); ++i)
      if (stashed_grads_[i].defined()) entries[i].param.mutable_grad() = stashed_grads_[i];
  }
  reduced_shard_ = at::Tensor();
  for (auto& g : stashed_grads_) g = at::Tensor();
  stashed_ = false;
  std::fill(fired_flags_.begin(), fired_flags_.end(), false);
  fired_ = 0;
  runtime_->tracer().end(trace_name("backward"), Tracer::kCompute, backward_mark_);
  output_grad_seen_ = false;
  wait_gather();
  if (flat_->separate_unsharded()) {
    if (flat_->unsharded_allocated()) free_unsharded();
  }
  flat_->use_shard_views();
  state_ = UnitState::IDLE;
}

void Unit::reset_after_abandoned_forward() {
  // Forward without backward (evaluation, or a training forward whose loss was
  // dropped): put parameters and stashed gradients back as they were.
  auto& entries = flat_->entries();
  if (stashed_) {
    for (size_t i = 0; i < entries.size(); ++i) {
      entries[i].param.mutable_grad() = stashed_grads_[i];
      stashed_grads_[i] = at::Tensor();
    }
  }
  stashed_ = false;
  std::fill(fired_flags_.begin(), fired_flags_.end(), false);
  fired_ = 0;
  output_grad_seen_ = false;
  forward_mark_ = backward_mark_ = Tracer::Mark{};
  if (flat_->separate_unsharded() && flat_->unsharded_allocated()) free_unsharded();
  flat_->use_shard_views();
  state_ = UnitState::IDLE;
}

int64_t Unit::transient_bytes() const {
  int64_t b = flat_->unsharded_bytes();
  auto bytes = [](const at::Tensor& t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; };
  b += bytes(flat_grad_) + bytes(no_sync_grad_);
  return b;
}

int64_t Unit::grad_piece_bytes() const {
  int64_t b = 0;
  for (const auto& e : flat_->entries()) {
    const auto& g = e.param.grad();
    if (g.defined()) b += g.numel() * int64_t(g.element_size());
  }
  return b;
}

}  // namespace fsdp::detail
