#include "runtime.h"

#include <algorithm>

#include <torch/csrc/autograd/function_hook.h>

#include "fsdp/autograd/end_of_backward.h"

namespace fsdp::core::detail {

// The call site's interception points: straight into the runtime.
class Runtime::CallSite : public UnitHooks {
 public:
  CallSite(Runtime* runtime, Unit* unit) : runtime_(runtime), unit_(unit) {}
  void pre_forward() override { runtime_->pre_forward(*unit_); }
  void post_forward(const std::vector<at::Tensor>& outputs) override { runtime_->post_forward(*unit_, outputs); }
  std::optional<at::ScalarType> forward_input_dtype() const override { return unit_->forward_input_dtype(); }

 private:
  Runtime* runtime_;
  Unit* unit_;
};

namespace {

// Runs after AccumulateGrad has written a parameter's (full-shape) gradient.
class ParamGradHook : public torch::autograd::FunctionPostHook {
 public:
  ParamGradHook(Runtime* runtime, Unit* unit, size_t entry) : runtime_(runtime), unit_(unit), entry_(entry) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    runtime_->on_param_grad(*unit_, entry_);
    return outputs;
  }

 private:
  Runtime* runtime_;
  Unit* unit_;
  size_t entry_;
};

// Whether a forward now is followed by its backward: with grad, or as a checkpoint's
// first forward, whose backward comes through a recompute ([Note: recompute]).
bool forward_has_backward() { return at::GradMode::is_enabled() || autograd::in_checkpointed_forward(); }

}  // namespace

Runtime::Runtime(comm::ProcessGroup pg, ResolvedOptions options)
    : comm_(std::move(pg), options), options_(std::move(options)), policy_(options_) {
  // On one host the peers read the gathered and reduced buffers in place ([Note: exchange
  // arena]); every group of the world shares the process's arena. Device blocks come from
  // the device's allocator. A new block has no stream history ([Note: stream order wiring]).
  pool_.set_block_allocator(
      [g = comm_.gather_group()](size_t nbytes) { return comm::allocate_collective_buffer(g, nbytes); });
  pool_.set_new_block_observer([streams = &comm_.streams()](const at::DataPtr& block) { streams->new_block(block); });
  tracer_ = std::make_shared<Tracer>(options_.trace_dir, comm_.group().global_rank());
  if (tracer_->enabled()) tracer_->set_device_clock(comm_.streams().device_clock());
  // The window of reductions in flight ([Note: reduce buckets] in grad_reducer.h).
  const int max_scattering = options_.strategy == ShardingStrategy::kNoShard ? 2 : 1;
  reducer_ = std::make_unique<GradReducer>(comm_.reduce_group(), comm_.replica_group(), options_.bucket_cap_bytes,
                                           tracer_.get(), &pool_, max_scattering, &comm_.streams());
  reducer_->set_on_delivered([this](Unit& u) { on_shard_reduced(u); });
}

Runtime::~Runtime() {
  try {
    tracer_->flush();
  } catch (const std::exception&) {
    // A destructor must not throw; flush_trace() reports the error when called.
  }
}

Unit* Runtime::add_unit(std::string path, std::unique_ptr<FlatParameter> flat, bool is_root,
                        bool reshard_after_forward) {
  UnitContext ctx;
  ctx.rank = comm_.group().rank();
  ctx.gather_group = comm_.gather_group();
  ctx.pool = &pool_;
  ctx.tracer = tracer_.get();
  ctx.divide = options_.divide;
  ctx.cast_forward_inputs = options_.mixed_precision.cast_forward_inputs();
  ctx.streams = &comm_.streams();
  if (options_.zero_copy_gather && flat->sharded()) comm_.map_gathers(path, *flat);
  units_.push_back(std::make_unique<Unit>(std::move(ctx), static_cast<int>(units_.size()), std::move(path),
                                          std::move(flat), is_root, reshard_after_forward));
  return units_.back().get();
}

UnitHooks* Runtime::call_site(Unit* unit) {
  call_sites_.push_back(std::make_unique<CallSite>(this, unit));
  return call_sites_.back().get();
}

// ---- forward ----

void Runtime::root_pre_forward(Unit* root) {
  TORCH_CHECK(!autograd::in_checkpointed_forward() && !autograd::in_recompute(), "fsdp: rank ", comm_.group().rank(),
              ": the FullyShardedDataParallel root's forward runs inside fsdp::checkpoint, which FSDP does not "
              "support (its iteration starts and ends at the root). Checkpoint pieces inside the model instead: "
              "fsdp::apply_activation_checkpointing(*model, fsdp::checkpoint_module_type<BlockImpl>()) before "
              "wrapping, or fsdp::checkpoint inside a module's forward");
  // A previous training forward whose backward never ran leaves units waiting;
  // start the new iteration from a clean, sharded state.
  if (!callback_queued_) {
    for (auto& u : units_)
      if (u->state() != UnitState::kIdle) u->abandon_forward();
    pre_forward_order_.clear();
    post_forward_order_.clear();
    backward_planned_ = false;
  }
  if (at::GradMode::is_enabled()) {
    policy_.check_registered(comm_.group().rank());
    for (const auto& u : units_) u->check_requires_grad_unchanged(comm_.group().rank());
  }
  if (root) pre_forward(*root);
  arm_implicit_units();
}

void Runtime::arm_implicit_units() {
  // An implicit unit's forward is part of the root's: it goes through the same
  // two steps as a unit with a call site, at once, with no outputs to hook (its
  // gradients arrive through its parameters' AccumulateGrad hooks).
  for (Unit* u : implicit_units_) {
    pre_forward(*u);
    post_forward(*u, {});
  }
}

void Runtime::pre_forward(Unit& unit) {
  pre_forward_one(unit);
  if (Unit* frozen = unit.companion()) pre_forward_one(*frozen);  // [Note: frozen companions]
}

void Runtime::post_forward(Unit& unit, const std::vector<at::Tensor>& outputs) {
  if (Unit* frozen = unit.companion()) post_forward_one(*frozen, outputs);
  post_forward_one(unit, outputs);
}

void Runtime::pre_forward_one(Unit& unit) {
  if (autograd::in_recompute()) return pre_recompute(unit);
  if (std::find(pre_forward_order_.begin(), pre_forward_order_.end(), &unit) == pre_forward_order_.end())
    pre_forward_order_.push_back(&unit);
  const bool training = forward_has_backward();
  const bool allocated = unit.begin_forward(training, [this, &unit](size_t entry) {
    return std::make_unique<ParamGradHook>(this, &unit, entry);
  });
  if (allocated) note_transient_bytes();
  observe(unit, "pre_forward");
  prefetch_forward(unit);
  unit.open_forward_span();
}

void Runtime::post_forward_one(Unit& unit, const std::vector<at::Tensor>& outputs) {
  if (autograd::in_recompute()) return post_recompute(unit, outputs);
  const bool training = forward_has_backward();
  unit.end_forward(training, keeps_gathered_after_forward(unit));
  observe(unit, "post_forward");
  auto it = std::find(post_forward_order_.begin(), post_forward_order_.end(), &unit);
  if (it != post_forward_order_.end()) post_forward_order_.erase(it);  // last call counts
  post_forward_order_.push_back(&unit);
  if (!training) {
    // Root of an evaluation forward: everything is done.
    if (unit.is_root()) {
      // No reduction closes an evaluation's reads of the peers' mapped shards: wait until
      // every rank is done before any may write its own ([Note: zero-copy gathers]).
      if (comm_.mapped_gathers())
        comm::barrier(comm_.gather_group(), {comm::Phase::kForward, "end of evaluation (zero_copy_gather)"});
      pre_forward_order_.clear();
      post_forward_order_.clear();
    }
    return;
  }
  arm_output_hooks(unit, outputs);
}

void Runtime::arm_output_hooks(Unit& unit, const std::vector<at::Tensor>& outputs) {
  // Outputs without grad get none: a checkpoint's first forward arms them in its recompute.
  Unit* u = &unit;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    // register_hook on a copy registers on the same TensorImpl.
    at::Tensor t = out;
    t.register_hook([this, u](const at::Tensor& grad) {
      on_output_grad(*u);
      return grad;
    });
  }
}

// ---- recompute ([Note: recompute]) ----

void Runtime::pre_recompute(Unit& unit) {
  auto it = std::find(backward_gather_order_.begin(), backward_gather_order_.end(), &unit);
  TORCH_CHECK(callback_queued_ && it != backward_gather_order_.end(), "fsdp: unit '", unit.label(), "' on rank ",
              comm_.group().rank(), " is recomputed by fsdp::checkpoint in backward, but its first forward was not "
              "part of this iteration's forward with grad. Call the checkpointed function in the same forward whose "
              "loss backward runs on");
  gather_until(static_cast<int>(it - backward_gather_order_.begin()));
  const bool allocated = unit.begin_recompute([this, &unit](size_t entry) {
    return std::make_unique<ParamGradHook>(this, &unit, entry);
  });
  if (allocated) note_transient_bytes();
}

void Runtime::post_recompute(Unit& unit, const std::vector<at::Tensor>& outputs) {
  unit.end_recompute();
  arm_output_hooks(unit, outputs);
}

std::vector<const Unit*> Runtime::uncalled_entries() const {
  std::vector<const Unit*> out;
  for (const Unit* u : entry_units_)
    if (std::find(pre_forward_order_.begin(), pre_forward_order_.end(), u) == pre_forward_order_.end())
      out.push_back(u);
  return out;
}

const char* const Runtime::kEntryCallFix =
    "call each as fsdp::call<Impl>(list, i, args...) or fsdp::call<Impl>(dict, key, args...) (fsdp/core/call.h)";

void Runtime::check_entries_called() const {
  const std::vector<const Unit*> uncalled = uncalled_entries();
  if (uncalled.empty()) return;
  std::string paths;
  for (const Unit* u : uncalled) paths += (paths.empty() ? "'" : ", '") + u->path() + "'";
  TORCH_CHECK(false, "fsdp: rank ", comm_.group().rank(), ": the unit(s) ", paths, " are ModuleList or ModuleDict "
              "entries that this forward did not call through fsdp::call, so their parameters were not gathered "
              "(they are this rank's flat shards) and their gradients would not be reduced: ", kEntryCallFix,
              ", in every forward; an entry a forward may skip can be declared fsdp::Wrappable<Impl> instead");
}

void Runtime::root_post_forward(Unit* root, const std::vector<at::Tensor>& outputs) {
  check_entries_called();
  if (root) post_forward(*root, outputs);
  if (at::GradMode::is_enabled() && !pre_forward_order_.empty()) recorded_forward_order_ = pre_forward_order_;
  release_stray_prefetches();
  if (!at::GradMode::is_enabled()) return;
  // The gradients of the model's outputs are the first thing backward computes:
  // that is where units set their earlier gradient pieces aside (also when the
  // root holds no parameters and so has no unit of its own).
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    at::Tensor t = out;
    t.register_hook([this](const at::Tensor& grad) {
      on_root_output_grad();
      return grad;
    });
  }
}

// ---- prefetch ([Note: prefetch]) ----

bool Runtime::may_prefetch(const Unit& current) const {
  if (!options_.limit_all_gathers) return true;
  for (const auto& u : units_)
    if (u.get() != &current && u->gather_pending()) return false;
  return true;
}

void Runtime::prefetch_forward(const Unit& current) {
  if (!options_.forward_prefetch) return;
  auto it = std::find(recorded_forward_order_.begin(), recorded_forward_order_.end(), &current);
  if (it == recorded_forward_order_.end() || ++it == recorded_forward_order_.end()) return;
  Unit* next = *it;
  // Only a unit that has not run forward yet in this iteration.
  if (next->state() != UnitState::kIdle || !next->needs_gather() || !may_prefetch(current)) return;
  if (next->issue_gather(comm::Phase::kForward)) note_transient_bytes();
}

void Runtime::prefetch_backward(const Unit& current) {
  auto it = std::find(backward_gather_order_.begin(), backward_gather_order_.end(), &current);
  if (it == backward_gather_order_.end()) return;
  const int pos = static_cast<int>(it - backward_gather_order_.begin());
  if (!may_prefetch(current)) return;
  gather_until(pos + 1);  // the same cursor as without prefetch: order unchanged
}

void Runtime::release_stray_prefetches() {
  // A forward prefetch of a unit that then did not run (the forward took another
  // path): wait for it and free the buffer, as if it had never been gathered.
  for (auto& u : units_)
    if (u->state() == UnitState::kIdle && u->flat().separate_unsharded() && u->flat().unsharded_allocated() &&
        u->flat().state() == FlatState::kSharded)
      u->release_prefetch();
}

// ---- backward ----

void Runtime::plan_backward() {
  if (backward_planned_) return;
  backward_planned_ = true;
  backward_gather_order_.assign(post_forward_order_.rbegin(), post_forward_order_.rend());
  reduce_order_.assign(pre_forward_order_.rbegin(), pre_forward_order_.rend());
  gather_ptr_ = 0;
  reduce_ptr_ = 0;
  // [Note: last unit stays gathered]: the first non-root unit of the backward
  // order, and with BACKWARD_PRE the second, which that unit's backward prefetches.
  const size_t keep = options_.backward_prefetch == BackwardPrefetch::kBackwardPre ? 2 : 1;
  kept_after_forward_.clear();
  for (auto it = post_forward_order_.rbegin(); it != post_forward_order_.rend() && kept_after_forward_.size() < keep;
       ++it)
    if (!(*it)->is_root()) kept_after_forward_.push_back(*it);  // each unit is there once
}

void Runtime::ensure_final_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  plan_backward();
  // On the outermost backward: a checkpoint's nested backward must not end the iteration.
  autograd::queue_end_of_backward([this] { final_callback(); });
}

void Runtime::on_root_output_grad() {
  ensure_final_callback();
  // Backward starts: every unit that ran forward with grad moves its earlier
  // gradient pieces aside before any AccumulateGrad runs (see Unit::stash_grads).
  // Units whose outputs get no gradient on this rank are included, so their
  // pieces come back unchanged at the end (plus the reduced zeros).
  for (auto& u : units_) u->stash_grads();
}

void Runtime::gather_until(int position) {
  for (; static_cast<int>(gather_ptr_) <= position && gather_ptr_ < backward_gather_order_.size();
       ++gather_ptr_) {
    Unit* u = backward_gather_order_[gather_ptr_];
    if (u->state() == UnitState::kAwaitBackward && u->needs_gather() && u->gather_ahead_of_backward())
      note_transient_bytes();
  }
}

void Runtime::on_output_grad(Unit& unit) {
  ensure_final_callback();
  unit.stash_grads();
  // Only the first output hook of this iteration; a unit gathered ahead (by the
  // backward order or a prefetch) still comes here, so that it waits for its
  // gather and prefetches the next one.
  if (unit.state() != UnitState::kAwaitBackward && unit.state() != UnitState::kGatheredForBackward) return;
  deliver_landed_shards();
  auto it = std::find(backward_gather_order_.begin(), backward_gather_order_.end(), &unit);
  TORCH_INTERNAL_ASSERT(it != backward_gather_order_.end(), "unit not in this iteration's forward");
  gather_until(static_cast<int>(it - backward_gather_order_.begin()));
  if (unit.begin_backward()) note_transient_bytes();
  observe(unit, "pre_backward");
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPre) prefetch_backward(unit);
  unit.open_backward_span();
}

void Runtime::on_param_grad(Unit& unit, size_t entry) {
  ensure_final_callback();
  if (unit.note_param_grad(entry)) on_grads_complete(unit);
}

void Runtime::on_grads_complete(Unit& unit) {
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost) prefetch_backward(unit);
  while (reduce_ptr_ < reduce_order_.size()) {
    Unit* u = reduce_order_[reduce_ptr_];
    if (u->has_grad_params() && !u->grads_complete()) break;
    if (u->awaits_reduction()) reduce(*u);
    ++reduce_ptr_;
  }
  deliver_landed_shards();
}

void Runtime::reduce(Unit& unit) {
  // A unit whose parameters are all frozen has nothing to reduce, but its
  // backward may not have run yet (its parameters still feed the input
  // gradient): it keeps its state so that its output hook still re-gathers it,
  // and finish_iteration reshards it.
  if (!unit.has_grad_params()) return;
  // The reducer bounds the reductions in flight ([Note: reductions in
  // flight] in src/engine/reduction_window.h): making room completes the oldest
  // before this unit's flat gradient exists, so backward holds a few buckets'
  // gradients instead of the whole model's.
  const bool no_sync = policy_.no_sync();
  if (!no_sync) reducer_->make_room(unit);
  unit.flatten_grads(no_sync);
  note_transient_bytes();
  if (!no_sync) {
    reducer_->add(&unit);
    note_transient_bytes();
  }
  observe(unit, "post_backward");
}

void Runtime::on_shard_reduced(Unit& unit) {
  // [Note: optimizer in backward]: only a final reduction steps. Under no_sync nothing
  // is reduced; under no_step the pieces are assigned at the end of backward as usual.
  if (!policy_.steps_reduced_shards()) return;
  policy_.step(unit, tracer_.get());
  observe(unit, "stepped");
}

void Runtime::deliver_landed_shards() {
  // Polled at each unit's backward hooks, the only moments the backward thread is ours;
  // without an in-backward optimizer a shard can wait for the end of backward.
  if (!policy_.steps_in_backward()) return;
  reducer_->deliver_landed();
}

void Runtime::final_callback() {
  // Everything not yet issued, in the fixed orders, so all ranks match.
  gather_until(static_cast<int>(backward_gather_order_.size()) - 1);
  for (; reduce_ptr_ < reduce_order_.size(); ++reduce_ptr_) {
    Unit* u = reduce_order_[reduce_ptr_];
    if (u->awaits_reduction()) reduce(*u);
  }
  reducer_->finish();  // every reduced shard is in place before pieces are assigned
  policy_.wait_for_host_steps(*tracer_);
  for (Unit* u : backward_gather_order_) u->wait_gather();
  for (Unit* u : reduce_order_) u->finish_iteration();
  policy_.place_after_warmup(reduce_order_);
  callback_queued_ = false;
  backward_planned_ = false;
  pre_forward_order_.clear();
  post_forward_order_.clear();
}

// ---- memory ----

void Runtime::note_transient_bytes() {
  int64_t b = 0;
  for (auto& u : units_) b += u->transient_bytes();
  if (reducer_) b += reducer_->transient_bytes();
  peak_transient_ = std::max(peak_transient_, b);
}

MemoryStats Runtime::memory_stats() const {
  MemoryStats s;
  for (const auto& u : units_) {
    const int64_t param_bytes = u->flat().shard().numel() * int64_t(u->flat().shard().element_size());
    const int64_t grad_bytes = u->grad_piece_bytes();
    s.param_shard_bytes += param_bytes;
    s.grad_shard_bytes += grad_bytes;
    if (u->flat().offloaded()) s.offloaded_bytes += param_bytes + grad_bytes;
    s.unsharded_bytes += u->transient_bytes();
  }
  s.unsharded_bytes += reducer_->transient_bytes();
  s.unsharded_peak_bytes = std::max(peak_transient_, s.unsharded_bytes);
  s.cached_bytes = pool_.idle_bytes();
  return s;
}

void Runtime::reset_peak() { peak_transient_ = 0; }

}  // namespace fsdp::core::detail
