#include "runtime.h"

#include <algorithm>
#include <cstdlib>

#include <torch/csrc/autograd/engine.h>

namespace fsdp::detail {

namespace {
// PyTorch's default split of the 1/world gradient average into a division before
// and one after the reduction (keeps low-precision sums in range).
double default_predivide(int world) {
  int factor = 1;
  while (world % factor == 0 && world / factor > factor) factor *= 2;
  return factor;
}
}  // namespace

Runtime::Runtime(dist::ProcessGroup pg, Options options)
    : pg_(std::move(pg)), options_(std::move(options)) {
  const int world = pg_.size();
  build_hybrid_groups();
  const int n = shard_pg_.size();
  // Dedicated groups over the shard group's ranks, so that gathers and
  // reductions form two independent sequences (see [Note: collective order]).
  // Created in the same order on every rank.
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r) all[r] = r;
  gather_pg_ = shard_pg_.new_subgroup(all);
  reduce_pg_ = options_.reduce_group().defined() ? options_.reduce_group() : shard_pg_.new_subgroup(all);
  TORCH_CHECK(reduce_pg_.size() == n, "fsdp: reduce_group has ", reduce_pg_.size(),
              " ranks but the sharding group has ", n, "; they must cover the same ranks");
  // The gradient average is over the whole world (shard group x replica group).
  double pre = options_.gradient_predivide_factor();
  TORCH_CHECK(pre >= 0, "fsdp: gradient_predivide_factor must be >= 1 (or 0 for the default), got ", pre);
  if (pre == 0) pre = default_predivide(world);
  TORCH_CHECK(pre >= 1 && pre <= world, "fsdp: gradient_predivide_factor must lie in [1, world size ",
              world, "], got ", pre);
  predivide_ = pre;
  postdivide_ = world / pre;
  std::string dir = options_.trace_dir();
  if (dir.empty())
    if (const char* env = std::getenv("FSDP_TRACE")) dir = env;
  tracer_ = std::make_unique<Tracer>(dir, pg_.global_rank());
  // [Note: reductions in flight]
  const int max_scattering = options_.sharding_strategy() == ShardingStrategy::NO_SHARD ? 2 : 1;
  reducer_ = std::make_unique<GradReducer>(reduce_pg_, replica_pg_, bucket_cap_bytes(options_), tracer_.get(),
                                           &pool_, max_scattering);
}

void Runtime::build_hybrid_groups() {
  if (options_.sharding_strategy() != ShardingStrategy::HYBRID_SHARD) {
    shard_pg_ = pg_;
    return;
  }
  int g = options_.shard_group_size();
  if (g == 0) g = pg_.local_world_size();
  TORCH_CHECK(g >= 1 && pg_.size() % g == 0, "fsdp: HYBRID_SHARD on rank ", pg_.rank(),
              ": shard_group_size ", g, " must divide the world size ", pg_.size(),
              "; set Options::shard_group_size (0 means ranks per machine, here ",
              pg_.local_world_size(), ")");
  shard_pg_ = pg_.split_consecutive(g);
  replica_pg_ = pg_.split_strided(g);
  TORCH_INTERNAL_ASSERT(shard_pg_.defined() && replica_pg_.defined());
}

Runtime::~Runtime() {
  try {
    tracer_->flush();
  } catch (const std::exception&) {
    // A destructor must not throw; flush_trace() reports the error when called.
  }
}

void Runtime::add_unit(std::unique_ptr<Unit> unit) { units_.push_back(std::move(unit)); }

void Runtime::root_pre_forward() {
  // A previous training forward whose backward never ran leaves units waiting;
  // start the new iteration from a clean, sharded state.
  if (!callback_queued_) {
    for (auto& u : units_)
      if (u->state() != UnitState::IDLE) u->reset_after_abandoned_forward();
    pre_forward_order_.clear();
    post_forward_order_.clear();
    backward_planned_ = false;
  }
}

void Runtime::root_post_forward() {
  if (at::GradMode::is_enabled() && !pre_forward_order_.empty()) recorded_forward_order_ = pre_forward_order_;
  release_stray_prefetches();
}

void Runtime::arm_implicit_units() {
  for (Unit* u : implicit_units_) {
    u->pre_forward();
    u->post_forward({});
  }
}

void Runtime::on_unit_pre_forward(Unit* unit) {
  if (std::find(pre_forward_order_.begin(), pre_forward_order_.end(), unit) == pre_forward_order_.end())
    pre_forward_order_.push_back(unit);
}

// ---- prefetch ([Note: prefetch]) ----

bool Runtime::may_prefetch(const Unit* current) const {
  if (!options_.limit_all_gathers()) return true;
  for (const auto& u : units_)
    if (u.get() != current && u->gather_pending()) return false;
  return true;
}

void Runtime::prefetch_forward(Unit* current) {
  if (!options_.forward_prefetch()) return;
  auto it = std::find(recorded_forward_order_.begin(), recorded_forward_order_.end(), current);
  if (it == recorded_forward_order_.end() || ++it == recorded_forward_order_.end()) return;
  Unit* next = *it;
  // Only a unit that has not run forward yet in this iteration.
  if (next->state() != UnitState::IDLE || !next->needs_backward_gather() || !may_prefetch(current)) return;
  next->issue_gather();
}

void Runtime::prefetch_backward(Unit* current) {
  auto it = std::find(backward_gather_order_.begin(), backward_gather_order_.end(), current);
  if (it == backward_gather_order_.end()) return;
  const int pos = static_cast<int>(it - backward_gather_order_.begin());
  if (!may_prefetch(current)) return;
  gather_until(pos + 1);  // the same cursor as without prefetch: order unchanged
}

void Runtime::release_stray_prefetches() {
  // A forward prefetch of a unit that then did not run (the forward took another
  // path): wait for it and free the buffer, as if it had never been gathered.
  for (auto& u : units_)
    if (u->state() == UnitState::IDLE && u->flat().separate_unsharded() && u->flat().unsharded_allocated() &&
        u->flat().state() == detail::FlatState::Sharded)
      u->reset_after_abandoned_forward();
}

void Runtime::on_unit_post_forward(Unit* unit) {
  auto it = std::find(post_forward_order_.begin(), post_forward_order_.end(), unit);
  if (it != post_forward_order_.end()) post_forward_order_.erase(it);  // last call counts
  post_forward_order_.push_back(unit);
  if (!at::GradMode::is_enabled() && unit->is_root()) {
    // Root of an evaluation forward: everything is done, reshard the root too.
    unit->reset_after_abandoned_forward();
    pre_forward_order_.clear();
    post_forward_order_.clear();
  }
}

void Runtime::plan_backward() {
  if (backward_planned_) return;
  backward_planned_ = true;
  backward_gather_order_.assign(post_forward_order_.rbegin(), post_forward_order_.rend());
  reduce_order_.assign(pre_forward_order_.rbegin(), pre_forward_order_.rend());
  gather_ptr_ = 0;
  reduce_ptr_ = 0;
  // [Note: last unit stays gathered]
  kept_after_forward_ = nullptr;
  for (auto it = post_forward_order_.rbegin(); it != post_forward_order_.rend(); ++it)
    if (!(*it)->is_root()) {
      kept_after_forward_ = *it;
      break;
    }
}

void Runtime::ensure_final_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  plan_backward();
  torch::autograd::Engine::get_default_engine().queue_callback([this] { final_callback(); });
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
    if (u->state() == UnitState::AWAIT_BACKWARD && u->needs_backward_gather()) {
      u->issue_gather();  // waited for in the unit's output hook or before any free
      u->enter_backward();
    }
  }
}

void Runtime::on_unit_output_grad(Unit* unit) {
  auto it = std::find(backward_gather_order_.begin(), backward_gather_order_.end(), unit);
  TORCH_INTERNAL_ASSERT(it != backward_gather_order_.end(), "unit not in this iteration's forward");
  gather_until(static_cast<int>(it - backward_gather_order_.begin()));
  if (unit->needs_backward_gather()) {
    // Out of the planned order (the graph differs from the forward order):
    // still correct on this rank, but only safe if every rank does the same.
    unit->issue_gather();
  }
  unit->enter_backward();
  unit->wait_gather();
  if (options_.backward_prefetch() == BackwardPrefetch::BACKWARD_PRE) prefetch_backward(unit);
}

void Runtime::on_unit_grads_complete(Unit* unit) {
  if (options_.backward_prefetch() == BackwardPrefetch::BACKWARD_POST) prefetch_backward(unit);
  while (reduce_ptr_ < reduce_order_.size()) {
    Unit* u = reduce_order_[reduce_ptr_];
    if (u->has_grad_params() && !u->grads_complete()) break;
    if (u->state() == UnitState::AWAIT_BACKWARD || u->state() == UnitState::BACKWARD) reduce(u);
    ++reduce_ptr_;
  }
}

void Runtime::reduce(Unit* unit) {
  // The reducer keeps at most one reduction in flight: issuing the next waits
  // for the previous one, which frees its flat gradients and receive buffer, so
  // backward holds one or two buckets' gradients instead of the whole model's.
  // On 2-core CPU machines Gloo's threads get no idle core anyway.
  if (unit->has_grad_params() && !no_sync_) reducer_->make_room(*unit);
  if (unit->flatten_grads(no_sync_)) {
    reducer_->add(unit);
    note_transient_bytes();
  }
}

void Runtime::final_callback() {
  // Everything not yet issued, in the fixed orders, so all ranks match.
  gather_until(static_cast<int>(backward_gather_order_.size()) - 1);
  for (; reduce_ptr_ < reduce_order_.size(); ++reduce_ptr_) {
    Unit* u = reduce_order_[reduce_ptr_];
    if (u->state() == UnitState::AWAIT_BACKWARD || u->state() == UnitState::BACKWARD) reduce(u);
  }
  reducer_->finish();  // every reduced shard is in place before pieces are assigned
  for (Unit* u : backward_gather_order_) u->wait_gather();
  for (Unit* u : reduce_order_) u->finish_iteration();
  callback_queued_ = false;
  backward_planned_ = false;
  pre_forward_order_.clear();
  post_forward_order_.clear();
}

void Runtime::note_transient_bytes() {
  int64_t b = 0;
  for (auto& u : units_) b += u->transient_bytes();
  if (reducer_) b += reducer_->transient_bytes();
  peak_transient_ = std::max(peak_transient_, b);
}

MemoryStats Runtime::memory_stats() const {
  MemoryStats s;
  for (const auto& u : units_) {
    s.param_shard_bytes += u->flat().shard().numel() * int64_t(u->flat().shard().element_size());
    s.grad_shard_bytes += u->grad_piece_bytes();
    s.unsharded_bytes += u->transient_bytes();
  }
  s.unsharded_bytes += reducer_->transient_bytes();
  s.unsharded_peak_bytes = std::max(peak_transient_, s.unsharded_bytes);
  s.cached_bytes = pool_.idle_bytes();
  return s;
}

void Runtime::reset_peak() { peak_transient_ = 0; }

}  // namespace fsdp::detail
