#include "unit.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include <ATen/ScalarOps.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "memory/storage_alias.h"
#include "phase_span.h"

namespace fsdp::core::detail {

const char* to_string(UnitState s) {
  switch (s) {
    case UnitState::kIdle: return "IDLE";
    case UnitState::kForward: return "FORWARD";
    case UnitState::kAwaitBackward: return "AWAIT_BACKWARD";
    case UnitState::kGatheredForBackward: return "GATHERED_FOR_BACKWARD";
    case UnitState::kBackward: return "BACKWARD";
    case UnitState::kRecompute: return "RECOMPUTE";
    case UnitState::kReducing: return "REDUCING";
    case UnitState::kAccumulated: return "ACCUMULATED";
    case UnitState::kReduced: return "REDUCED";
    case UnitState::kStepped: return "STEPPED";
  }
  return "?";
}

bool unit_transition_allowed(UnitState from, UnitState to) {
  using S = UnitState;
  switch (to) {
    case S::kForward:  // begin_forward; a unit may run forward more than once per iteration
      return from == S::kIdle || from == S::kForward || from == S::kAwaitBackward;
    case S::kAwaitBackward:  // end_forward with grad
      return from == S::kForward;
    case S::kGatheredForBackward:  // gather_ahead_of_backward; end_recompute
      return from == S::kAwaitBackward || from == S::kRecompute;
    case S::kBackward:  // begin_backward; end_recompute of a recompute entered from BACKWARD
      return from == S::kAwaitBackward || from == S::kGatheredForBackward || from == S::kRecompute;
    case S::kRecompute:  // begin_recompute
      return from == S::kAwaitBackward || from == S::kGatheredForBackward || from == S::kBackward;
    case S::kReducing:  // flatten_grads
    case S::kAccumulated:  // flatten_grads under no_sync
      return from == S::kAwaitBackward || from == S::kGatheredForBackward || from == S::kBackward;
    case S::kReduced:  // adopt_reduced_shard
      return from == S::kReducing;
    case S::kStepped:  // step_reduced_shard
      return from == S::kReduced;
    case S::kIdle:
      // end_forward without grad and abandon_forward (FORWARD, AWAIT_BACKWARD);
      // finish_iteration (everything that ran forward in this iteration, except a
      // flat gradient still with the reducer, or a recompute still running).
      return from != S::kReducing && from != S::kRecompute;
  }
  return false;
}

Unit::Unit(UnitContext context, int index, std::string path, std::unique_ptr<FlatParameter> flat, bool is_root,
           bool reshard_after_forward)
    : ctx_(std::move(context)), index_(index), path_(std::move(path)), flat_(std::move(flat)),
      is_root_(is_root), reshard_after_forward_(reshard_after_forward && flat_->sharded()) {
  TORCH_INTERNAL_ASSERT(ctx_.pool && ctx_.tracer, "unit '", label(), "' without a buffer pool or tracer");
  const auto& entries = flat_->entries();
  fired_flags_.assign(entries.size(), false);
  accumulators_.resize(entries.size());
  for (const auto& e : entries) {
    if (e.param.requires_grad()) ++num_grad_params_;
    else has_frozen_params_ = true;
    built_trainable_.push_back(e.param.requires_grad());
  }
}

void Unit::check_requires_grad_unchanged(int rank) const {
  const auto& entries = flat_->entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].param.requires_grad() == built_trainable_[i]) continue;
    TORCH_CHECK(false, "fsdp (rank ", rank, "): parameter '", entries[i].fqn, "' (unit '", label(), "') was ",
                built_trainable_[i] ? "frozen" : "unfrozen", " after the model was wrapped. FSDP lays trainable and "
                "frozen parameters out apart when it wraps (frozen ones hold no gradient, optimizer state or "
                "reduction traffic), so set requires_grad before wrapping: freeze, then build the "
                "FullyShardedDataParallel");
  }
}

void Unit::transition(UnitState to, const char* event) {
  TORCH_CHECK(unit_transition_allowed(state_, to), "fsdp: unit '", label(), "' on rank ", ctx_.rank, ": ",
              event, " would move it from ", to_string(state_), " to ", to_string(to),
              ", which its lifecycle does not allow ([Note: unit lifecycle] in src/core/unit.h). Was "
              "forward called twice without backward inside one unit, or a module called from another thread?");
  state_ = to;
}

bool Unit::needs_gather() const { return flat_->separate_unsharded() && !flat_->unsharded_allocated(); }

// ---- asynchronous gathers and their trace spans ([Note: prefetch] in runtime.h) ----

std::string Unit::trace_name(const char* what) const { return std::string(what) + " " + label(); }

bool Unit::issue_gather(comm::Phase phase) {
  if (!needs_gather()) return false;
  try {
    flat_->alloc_unsharded(*ctx_.pool);
  } catch (const c10::OutOfMemoryError& e) {
    out_of_memory(e, "gathering the parameters", flat_->padded_numel() * int64_t(c10::elementSize(flat_->compute_dtype())));
  }
  if (flat_->sharded()) {
    pending_gather_ = GatherResult::issue(*flat_, ctx_.gather_group, {phase, label()}, streams(), ctx_.tracer);
  } else {
    at::NoGradGuard no_grad;  // NO_SHARD with param_dtype: a local low-precision copy
    if (auto* so = streams()) so->acquire(StreamKind::kCompute, flat_->unsharded(), "unsharded flat parameter", label());
    flat_->unsharded().copy_(flat_->shard());
    if (auto* so = streams()) so->write(StreamKind::kCompute, flat_->unsharded());
  }
  return true;
}

void Unit::wait_gather() {
  if (!pending_gather_) return;
  // Cleared before waiting, so that a failed wait does not leave a stale handle.
  GatherResult g = std::move(*pending_gather_);
  pending_gather_.reset();
  g.wait();
}

// ---- stream order ([Note: stream order wiring] in runtime.h) ----

void Unit::order_compute_reads_unsharded() {
  StreamOrder* so = streams();
  if (!so || !flat_->separate_unsharded()) return;
  so->read(StreamKind::kCompute, flat_->unsharded());
}

void Unit::free_unsharded() {
  wait_gather();  // never free a buffer a collective is still writing into
  // Compute gives the block back behind its last read of it ([Note: stream order]).
  if (auto* so = streams(); so && flat_->unsharded_allocated()) so->release(StreamKind::kCompute, flat_->unsharded());
  flat_->free_unsharded();
}

void Unit::out_of_memory(const c10::OutOfMemoryError& e, const char* what, int64_t bytes) const {
  std::ostringstream size;
  if (bytes > 0) size << " (" << bytes << " bytes on " << flat_->options().device() << ")";
  TORCH_CHECK_WITH(OutOfMemoryError, false, "fsdp (rank ", ctx_.rank, "): out of memory ", what, " of unit '",
                   label(), "'", size.str(), ". Shard over more ranks, wrap "
                   "smaller units, compute in bf16 (MixedPrecision), or keep the shards, gradients and optimizer "
                   "state in host memory with Options::cpu_offload(true). ", e.what_without_backtrace());
}

void Unit::reshard() {
  wait_gather();
  if (flat_->separate_unsharded() && flat_->unsharded_allocated()) free_unsharded();
  flat_->use_shard_views();
}

void Unit::ensure_grad_accumulators(const GradHookFactory& make_hook) {
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
    acc->add_post_hook(make_hook(i));
    accumulators_[i] = std::move(acc);
  }
}

// ---- forward ----

bool Unit::begin_forward(bool training, const GradHookFactory& make_hook) {
  transition(UnitState::kForward, "pre_forward");
  // Gradient pieces from earlier backward passes stay on the parameters until
  // backward starts (stash_grads), so that the user can still zero or read them.
  const bool allocated = issue_gather(comm::Phase::kForward);
  wait_gather();
  order_compute_reads_unsharded();
  if (flat_->state() != FlatState::kUnsharded) flat_->use_unsharded_views();
  if (training) ensure_grad_accumulators(make_hook);
  return allocated;
}

void Unit::open_forward_span() {
  if (!forward_mark_.open()) forward_mark_ = ctx_.tracer->begin(Tracer::kCompute);
}

void Unit::end_forward(bool training, bool keep_gathered) {
  TORCH_CHECK(state_ == UnitState::kForward, "fsdp: unit '", label(), "' on rank ", ctx_.rank,
              ": post_forward in state ", to_string(state_), ", expected FORWARD. Was forward called twice "
              "without backward inside one unit, or a module called from another thread?");
  ctx_.tracer->end(trace_name("forward"), Tracer::kCompute, forward_mark_);
  if (!training) {
    // Evaluation: no backward follows, so return to the sharded state now. The
    // root's post_forward runs once the whole forward is done.
    abandon_forward();
    return;
  }
  transition(UnitState::kAwaitBackward, "post_forward");
  if (reshard_after_forward_ && !is_root_ && !keep_gathered) {
    free_unsharded();  // views stay; backward re-gathers into the same storage
  }
}

void Unit::clear_iteration() {
  stashed_grads_.reset();
  std::fill(fired_flags_.begin(), fired_flags_.end(), false);
  fired_ = 0;
}

void Unit::abandon_forward() {
  // Forward without backward (evaluation, or a training forward whose loss was
  // dropped): put parameters and set-aside gradients back as they were.
  transition(UnitState::kIdle, "abandoned forward");
  if (stashed_grads_) {
    auto& entries = flat_->entries();
    for (size_t i = 0; i < entries.size(); ++i) entries[i].param.mutable_grad() = (*stashed_grads_)[i];
  }
  clear_iteration();
  forward_mark_ = backward_mark_ = Tracer::Mark{};
  reshard();
}

void Unit::release_prefetch() {
  TORCH_INTERNAL_ASSERT(state_ == UnitState::kIdle, "unit '", label(), "' releases a prefetch in state ",
                        to_string(state_));
  reshard();
}

std::optional<at::ScalarType> Unit::forward_input_dtype() const {
  if (!flat_->low_precision() || !ctx_.cast_forward_inputs) return std::nullopt;
  return flat_->compute_dtype();
}

// ---- backward ----

bool Unit::awaits_reduction() const {
  return state_ == UnitState::kAwaitBackward || state_ == UnitState::kGatheredForBackward ||
         state_ == UnitState::kBackward;
}

void Unit::stash_grads() {
  // Gradient pieces from earlier backward passes (accumulation without no_sync)
  // cannot stay on parameters that now have their full shape: AccumulateGrad
  // would add the full gradient to the piece. They are moved aside when this
  // iteration's backward starts and added back to the new pieces at its end.
  // Not at forward: between forward and backward the pieces are the user's
  // (forward -> zero_grad -> backward is a common order; stashing at forward
  // hid them from zero_grad and added the old gradients back after backward).
  if (stashed_grads_ || !awaits_reduction()) return;
  auto& entries = flat_->entries();
  std::vector<at::Tensor> stashed(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    auto& g = entries[i].param.mutable_grad();
    stashed[i] = g;
    g = at::Tensor();
  }
  stashed_grads_ = std::move(stashed);
}

bool Unit::gather_ahead_of_backward() {
  transition(UnitState::kGatheredForBackward, "backward gather");
  return issue_gather(comm::Phase::kBackward);  // waited for in begin_backward or before any free
}

bool Unit::begin_backward() {
  // Out of the planned order (the graph differs from the forward order) the
  // gather is issued here: still correct on this rank, but only safe if every
  // rank does the same.
  const bool allocated = issue_gather(comm::Phase::kBackward);
  transition(UnitState::kBackward, "output gradient hook");
  wait_gather();
  order_compute_reads_unsharded();
  return allocated;
}

void Unit::open_backward_span() { backward_mark_ = ctx_.tracer->begin(Tracer::kCompute); }

bool Unit::begin_recompute(const GradHookFactory& make_hook) {
  recompute_in_backward_ = state_ == UnitState::kBackward;
  transition(UnitState::kRecompute, "recompute (pre_forward inside backward)");
  const bool allocated = issue_gather(comm::Phase::kBackward);  // no-op when gathered in order
  wait_gather();
  order_compute_reads_unsharded();
  if (flat_->state() != FlatState::kUnsharded) flat_->use_unsharded_views();
  ensure_grad_accumulators(make_hook);
  recompute_mark_ = ctx_.tracer->begin(Tracer::kCompute);
  return allocated;
}

void Unit::end_recompute() {
  TORCH_CHECK(state_ == UnitState::kRecompute, "fsdp: unit '", label(), "' on rank ", ctx_.rank,
              ": post_forward of a recompute in state ", to_string(state_), ", expected RECOMPUTE. Does the "
              "checkpointed function call the unit's forward from another thread?");
  ctx_.tracer->end(trace_name("recompute"), Tracer::kCompute, recompute_mark_);
  transition(recompute_in_backward_ ? UnitState::kBackward : UnitState::kGatheredForBackward, "end of recompute");
}

bool Unit::note_param_grad(size_t entry) {
  if (fired_flags_[entry]) {
    // A second AccumulateGrad in one backward (a checkpoint's nested backward, then the
    // outer one) adds to the full gradient; after flatten_grads nothing would read it.
    TORCH_CHECK(awaits_reduction(), "fsdp: parameter '", flat_->entries()[entry].fqn, "' of unit '", label(),
                "' on rank ", ctx_.rank, " received a second gradient in one backward after its unit's gradients "
                "were handed to the reduction (state ", to_string(state_), "). Its uses are split by an activation "
                "checkpoint (used both inside fsdp::checkpoint and outside it): keep all of the parameter's uses "
                "on one side of the checkpoint");
    return false;
  }
  fired_flags_[entry] = true;
  ++fired_;
  if (!grads_complete()) return false;
  ctx_.tracer->end(trace_name("backward"), Tracer::kCompute, backward_mark_);
  return true;
}

void Unit::flatten_grads(bool no_sync) {
  TORCH_INTERNAL_ASSERT(has_grad_params(), "unit '", label(), "' has no gradient parameters to flatten");
  PhaseSpan flattening(ctx_.tracer, "flatten", label());
  transition(no_sync ? UnitState::kAccumulated : UnitState::kReducing, "flatten_grads");
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
  try {
    flat_grad_ = ctx_.pool->empty(flat_->padded_numel(), flat_->options().dtype(flat_->reduce_dtype()));
  } catch (const c10::OutOfMemoryError& e) {
    out_of_memory(e, "flattening the gradients", flat_->padded_numel() * int64_t(c10::elementSize(flat_->reduce_dtype())));
  }
  if (auto* so = streams()) so->acquire(StreamKind::kCompute, flat_grad_, "flat gradient", label());
  // The pre-division is fused into the copy (one pass over the gradient instead of
  // two) when that computes the same bits as copy-then-divide: the same division
  // kernel on the same values, i.e. no cast on the way in and nothing added first.
  const double pre = ctx_.divide.pre;
  const bool divide_now = !no_sync && pre != 1 && !no_sync_grad_.defined();
  // A wrapped number, as Tensor::div_(Scalar) makes of its argument: the same type
  // promotion and kernel.
  at::Tensor pre_divisor;
  if (divide_now) {
    pre_divisor = c10::scalar_to_tensor(pre);
    pre_divisor.unsafeGetTensorImpl()->set_wrapped_number(true);
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    auto& g = entries[i].param.mutable_grad();
    auto dst = flat_->view_of(flat_grad_, i);
    if (g.defined()) {
      if (divide_now && g.scalar_type() == dst.scalar_type()) {
        at::div_out(dst, g, pre_divisor);
      } else {
        dst.copy_(g);
        if (divide_now) dst.div_(pre);
      }
      g = at::Tensor();  // the full gradient is freed here
    } else {
      dst.zero_();  // zero divided is zero
    }
  }
  if (flat_->padded_numel() > flat_->total_numel())
    flat_grad_.narrow(0, flat_->total_numel(), flat_->padded_numel() - flat_->total_numel()).zero_();
  if (no_sync_grad_.defined()) {
    flat_grad_.add_(no_sync_grad_);
    if (auto* so = streams()) so->release(StreamKind::kCompute, no_sync_grad_);
    no_sync_grad_ = at::Tensor();
  }
  if (no_sync) {
    no_sync_grad_ = std::move(flat_grad_);
    flat_grad_ = at::Tensor();
    return;
  }
  if (pre != 1 && !divide_now) flat_grad_.div_(pre);
  if (auto* so = streams()) so->write(StreamKind::kCompute, flat_grad_);  // the gradient is ready
}

at::Tensor Unit::take_flat_grad() {
  at::Tensor g = std::move(flat_grad_);
  flat_grad_ = at::Tensor();
  return g;
}

void Unit::adopt_reduced_shard(at::Tensor shard) {
  transition(UnitState::kReduced, "adopt_reduced_shard");
  reduced_shard_ = std::move(shard);
  if (ctx_.divide.post != 1) reduced_shard_.div_(ctx_.divide.post);
  // Gradient pieces in the optimizer's dtype (fp32 master) unless asked otherwise, where
  // the shard is ([Note: offload] in flat_param.h).
  reduced_shard_ = flat_->to_shard_side(reduced_shard_, flat_->grad_dtype());
}

namespace {

// Whether every byte of `t` is zero: true for a gradient the user zeroed
// (Optimizer::zero_grad fills with +0), so that finish_iteration need not add it.
// Adding +0 changes no value: x + 0 == x bit for bit for every x but -0, which
// becomes +0 (equal in value). The scan reads the piece once and stops at the
// first nonzero block, where the add reads the piece and the new gradient and
// writes the sum: on the step's memory-bound path that is one pass instead of three.
bool all_bits_zero(const at::Tensor& t) {
  if (!t.is_contiguous() || t.device().type() != c10::DeviceType::CPU) return false;
  static const char zeros[4096] = {};
  const char* p = static_cast<const char*>(t.data_ptr());
  size_t left = static_cast<size_t>(t.numel()) * t.element_size();
  while (left > 0) {
    const size_t n = std::min(left, sizeof zeros);
    if (std::memcmp(p, zeros, n) != 0) return false;
    p += n;
    left -= n;
  }
  return true;
}

}  // namespace

at::Tensor Unit::reduced_grad_piece(size_t i) const {
  at::Tensor piece = memory::storage_alias(flat_->piece_of(reduced_shard_, i));
  const at::Tensor stashed = stashed_grads_ ? (*stashed_grads_)[i] : at::Tensor();
  if (stashed.defined() && !all_bits_zero(stashed)) piece.add_(stashed.view(piece.sizes()));
  return piece;
}

void Unit::step_reduced_shard(const std::function<void()>& step) {
  transition(UnitState::kStepped, "optimizer step in backward");
  // Parameters with a gradient point at their shard pieces for the step, as they do
  // outside backward, so the optimizer sees the shapes (and state keys) it always
  // sees; frozen parameters keep their views (the optimizer skips them, and later
  // nodes of this backward may still read them).
  auto& entries = flat_->entries();
  std::vector<at::Tensor> autograd_views(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!entries[i].param.requires_grad()) continue;
    autograd_views[i] = entries[i].param.tensor_data();
    entries[i].param.set_data(flat_->piece_of(flat_->shard(), i));
    entries[i].param.mutable_grad() = reduced_grad_piece(i);
  }
  auto restore = [&] {
    for (size_t i = 0; i < entries.size(); ++i) {
      if (!autograd_views[i].defined()) continue;
      entries[i].param.mutable_grad() = at::Tensor();
      entries[i].param.set_data(autograd_views[i]);
    }
    reduced_shard_ = at::Tensor();
    stashed_grads_.reset();
  };
  try {
    step();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

void Unit::finish_iteration() {
  auto& entries = flat_->entries();
  TORCH_INTERNAL_ASSERT(!flat_grad_.defined(), "unit '", label(), "' finishes with an unreduced flat gradient");
  auto stashed = [&](size_t i) { return stashed_grads_ ? (*stashed_grads_)[i] : at::Tensor(); };
  const bool reduced = state_ == UnitState::kReduced;
  const bool stepped = state_ == UnitState::kStepped;
  transition(UnitState::kIdle, "finish_iteration");
  if (reduced) {
    for (size_t i = 0; i < entries.size(); ++i)
      if (entries[i].param.requires_grad()) entries[i].param.mutable_grad() = reduced_grad_piece(i);
  } else if (stepped) {
    // The step consumed this iteration's pieces and the ones set aside: no gradient.
  } else {
    // No reduction this iteration (no_sync, or no gradient parameters):
    // previous gradient pieces come back unchanged.
    for (size_t i = 0; i < entries.size(); ++i)
      if (stashed(i).defined()) entries[i].param.mutable_grad() = stashed(i);
  }
  reduced_shard_ = at::Tensor();
  clear_iteration();
  ctx_.tracer->end(trace_name("backward"), Tracer::kCompute, backward_mark_);
  reshard();
}

void Unit::place_shard_on_device() {
  TORCH_INTERNAL_ASSERT(state_ == UnitState::kIdle && !pending_gather_ && flat_->offloaded(), "unit '", label(),
                        "' placed on the device in state ", to_string(state_));
  auto& entries = flat_->entries();
  std::vector<at::Tensor> grads(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) grads[i] = std::move(entries[i].param.mutable_grad());
  flat_->place_on_compute_device();
  for (size_t i = 0; i < entries.size(); ++i)
    if (grads[i].defined()) entries[i].param.mutable_grad() = grads[i].to(flat_->options().device());
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

}  // namespace fsdp::core::detail
