#pragma once
// The runtime of one FullyShardedDataParallel root (FSDP2's FSDPState): the
// units and the per-iteration schedule, with the communication context the
// schedule's collectives run in (comm_context.h: process groups, stream order) and
// the step policy it asks about the optimizer step (step_policy.h). Control flows one
// way: every hook (the call sites' UnitHooks, the output-gradient hooks, the
// AccumulateGrad post hooks, the end-of-backward callback) enters the Runtime,
// and only the Runtime (with its GradReducer, grad_reducer.h) drives units,
// through the primitives of unit.h ([Note: unit lifecycle]). Units never call
// back; what they need from here is in their UnitContext.
//
// [Note: collective order]
// Gloo matches collectives by their sequence number per group, so every rank must
// issue the same collectives in the same order on each group. Ranks may differ in
// which units receive gradients (an unused branch on one rank), so hooks alone
// cannot order collectives. The runtime therefore issues them in orders fixed by
// the forward pass, which all ranks share:
//  * all-gathers (gather group): forward in call order; backward in reverse
//    post-forward order: when a unit's output hook fires, every unit before it in
//    that order that still needs its parameters is gathered first;
//  * reductions (reduce group): in reverse pre-forward order; a unit whose
//    gradients are complete waits for the units before it. Consecutive small
//    units may share one collective ([Note: reduce buckets] in grad_reducer.h);
//    buckets are formed from this order alone, so they match on every rank.
// The end-of-backward callback issues whatever is left, in the same orders, with
// zeros for gradients that were never produced, so no rank waits for a peer that
// will never send. Gathers and reductions use separate groups, so the two
// sequences do not constrain each other.
//
// [Note: prefetch]
// Prefetch moves *when* a gather is issued, never *which* gather comes next: the
// backward prefetch issues the next unit of backward_gather_order_ (the same
// cursor gather_until advances), asynchronously, before (BACKWARD_PRE) or after
// (BACKWARD_POST) the current unit's gradients are computed; the forward prefetch
// issues the unit that followed the current one in the previous iteration's
// pre-forward order. Both depend only on the forward order, which every rank
// shares, so every rank still issues the same gathers in the same order. A unit
// waits for its own gather where it first needs the data (pre_forward, its
// output hook) and before anything frees the buffer. limit_all_gathers keeps at
// most one prefetched gather in flight.
//
// [Note: recompute]
// An activation checkpoint (fsdp::checkpoint, include/fsdp/autograd/) runs a piece of
// forward without grad and re-runs it inside backward ([Note: nested backward] in
// include/fsdp/autograd/end_of_backward.h). A unit inside such a piece:
//  * first forward (autograd::in_checkpointed_forward()): a forward with grad for the
//    schedule: it enters the pre- and post-forward orders, so it has its place in the
//    backward gather order and the reduce order, and reshards after forward as usual.
//    Its outputs need no grad, so no output hook is armed yet;
//  * recompute (autograd::in_recompute()): not recorded in any order. Its pre_forward
//    advances the backward gather cursor up to it (gather_until, the same cursor the
//    output hooks and the prefetch advance, so every rank issues the same gathers in the
//    same order, and the gather is the one its backward needs anyway: FULL_SHARD still
//    moves every parameter three times per step), then RECOMPUTE ([Note: unit
//    lifecycle]); its post_forward arms the output hooks on the recomputed outputs and
//    keeps the parameters gathered for the backward that follows at once.
// A recompute runs units in forward order while the gather order is backward's, so all
// the units of one checkpointed piece are gathered together during its recompute.
// A checkpointed piece inside a unit needs nothing: the unit's output hook gathered it.
//
// [Note: last unit stays gathered]
// Under reshard_after_forward every non-root unit frees its gathered
// parameters after forward, except the non-root unit that finished forward
// last in the previous training iteration: backward starts with it, so freeing
// it would only be followed at once by a gather of the same bytes (one more
// collective per step, and its memory is needed again before anything else
// runs). Under BACKWARD_PRE (the default) the unit before it stays gathered too:
// that first unit's backward prefetches it before computing anything, while
// every activation of forward is still alive, so holding it from the end of
// forward adds nothing to the step's peak and saves its gather (the mlp bench
// model: 19% of the step's bytes). Without that prefetch it would add a unit to
// the peak, so only the first is kept. The choice depends only on the forward
// order and the options, which every rank shares, so every rank skips the same
// gathers. The first iteration reshards them (no order recorded yet); a forward
// that takes another path is still correct: a unit kept gathered needs no
// backward gather, any other unit is re-gathered.
//
// [Note: stream order wiring]
// Where the runtime declares its buffers' uses and waits to the stream order ([Note:
// stream order] in stream_order.h), all behind the seams of docs/architecture.md
// ("Seams around a unit's backward"): buffers come from the pool, waits go through handles.
//  * Unit::issue_gather: the all-gather stream waits an event compute records at the
//    issue (GatherWaitsCompute: covers the last reads of the pool block it overwrites,
//    the optimizer's writes to the shard, the low-precision cast), acquires the block and
//    writes the unsharded flat parameter;
//  * Unit::wait_gather (the gather's handle): compute waits the all-gather's event
//    (ComputeWaitsGather) and frees the cast source; begin_forward, begin_backward and
//    begin_recompute then read the unsharded flat parameter on compute;
//  * Unit::free_unsharded (reshard, after forward or backward): compute releases the
//    block behind its last read, so its next user waits on that;
//  * Unit::flatten_grads: compute acquires and writes the flat gradient;
//  * GradReducer::issue: the reduce-scatter stream waits the flat gradient's (or the
//    bucket's) write (ReduceWaitsCompute), reads it and writes the reduced output;
//  * GradReducer::deliver, the arrival point before adopt_reduced_shard and
//    on_shard_reduced: compute waits the reduction's event (ComputeWaitsReduce), frees
//    the input while the collective's handle still holds it, and reads the output.
// The pool tells the stream order of every new block, so a block's history is that of
// its reuses only. Off, every call returns at once: plain CPU training pays a branch.

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm_context.h"
#include "memory/buffer_pool.h"
#include "fsdp/core/options.h"
#include "fsdp/core/trace.h"
#include "fsdp/core/wrappable.h"
#include "grad_reducer.h"
#include "resolved_options.h"
#include "step_policy.h"
#include "unit.h"

namespace fsdp::core::detail {

class Runtime {
 public:
  Runtime(comm::ProcessGroup pg, ResolvedOptions options);
  ~Runtime();

  /// Creates unit number units().size() over the shard group.
  Unit* add_unit(std::string path, std::unique_ptr<FlatParameter> flat, bool is_root, bool reshard_after_forward);
  /// The hooks a call site (Wrappable, Sequential entry) invokes for `unit`;
  /// owned by the runtime.
  UnitHooks* call_site(Unit* unit);
  // Units without a call site of their own (full-precision BatchNorm units of
  // mixed precision): never sharded, so nothing needs gathering. Their forward
  // runs inside the root's, so the root's pre-forward takes them through their
  // forward right after its own unit, which puts them in the iteration's
  // schedule (reduced after every other unit, in unit order).
  void add_implicit_unit(Unit* unit) { implicit_units_.push_back(unit); }
  // [Note: frozen companions]
  // A unit whose parameters are partly frozen is built as two units at one call site: the
  // trainable parameters' unit, and a companion holding the frozen ones, each with a flat
  // buffer padded on its own. The companion never has gradients, so it holds no gradient
  // or optimizer bytes and moves nothing in reductions; it is gathered for the forward and
  // again for the backward (its parameters feed the input gradient), like a unit that is
  // frozen whole, and resharded at the end of backward. The call site drives both: the
  // pre-forward hooks run the unit's then the companion's, the post-forward hooks the
  // companion's then the unit's (a root unit's post-forward ends an evaluation). The cost
  // is a second gather per mixed unit.
  void set_companion(Unit* unit, Unit* frozen) { unit->set_companion(frozen); }
  // Units whose call site is fsdp::call (ModuleList and ModuleDict entries): each forward
  // must call them through it, or their parameters were never gathered.
  void add_entry_unit(Unit* unit) { entry_units_.push_back(unit); }
  /// The entry units this forward has not called (through fsdp::call) so far.
  std::vector<const Unit*> uncalled_entries() const;
  size_t entry_unit_count() const { return entry_units_.size(); }
  /// How to call an entry unit, for the errors that name one.
  static const char* const kEntryCallFix;

  std::vector<std::unique_ptr<Unit>>& units() { return units_; }
  const std::vector<std::unique_ptr<Unit>>& units() const { return units_; }

  /// Process groups and stream order.
  const CommContext& comm_context() const { return comm_; }
  /// no_sync, no_step, the optimizer in backward and placement after warm-up.
  StepPolicy& step_policy() { return policy_; }
  const StepPolicy& step_policy() const { return policy_; }
  Tracer& tracer() const { return *tracer_; }
  /// The trace, for a holder that may outlive the model (an asynchronous save's writer).
  const std::shared_ptr<Tracer>& shared_tracer() const { return tracer_; }
  /// Large per-iteration buffers ([Note: buffer pool]).
  memory::BufferPool& pool() { return pool_; }

  // Root forward boundaries (root: the root's unit, null when the root holds no
  // parameters of its own).
  void root_pre_forward(Unit* root);
  void root_post_forward(Unit* root, const std::vector<at::Tensor>& outputs);

  // Entry points of the hooks the runtime installs.
  void pre_forward(Unit& unit);                                             // call site
  void post_forward(Unit& unit, const std::vector<at::Tensor>& outputs);    // call site
  void pre_forward_one(Unit& unit);  // the two above, for one unit (not its companion)
  void post_forward_one(Unit& unit, const std::vector<at::Tensor>& outputs);
  void check_entries_called() const;  // at the root's post-forward: every entry unit ran
  void on_output_grad(Unit& unit);         // hook on a unit's outputs: its backward is next
  void on_param_grad(Unit& unit, size_t entry);  // AccumulateGrad post hook
  void on_root_output_grad();              // hook on the root's outputs: backward starts

  bool cpu_offload() const { return options_.cpu_offload; }

  /// Observer of unit boundaries, installed by the wrapper for the memory tracer
  /// (include/fsdp/core/memory_tracer.h): called with the unit's path and
  /// "pre_forward" | "post_forward" | "pre_backward" | "post_backward".
  using BoundaryObserver = std::function<void(const std::string& unit, const char* phase)>;
  void set_boundary_observer(BoundaryObserver observer) { observer_ = std::move(observer); }

  bool in_backward() const { return callback_queued_; }
  MemoryStats memory_stats() const;
  void reset_peak();

 private:
  class CallSite;

  void arm_implicit_units();
  void arm_output_hooks(Unit& unit, const std::vector<at::Tensor>& outputs);
  // [Note: recompute]
  void pre_recompute(Unit& unit);
  void post_recompute(Unit& unit, const std::vector<at::Tensor>& outputs);
  void ensure_final_callback();
  void final_callback();
  void plan_backward();
  void gather_until(int position);   // backward gathers up to this position
  void on_grads_complete(Unit& unit);
  /// A unit's reduced shard arrived (the GradReducer's delivery): the one arrival
  /// point of a reduced shard, once per unit and iteration.
  void on_shard_reduced(Unit& unit);
  /// With the optimizer inside backward: hands over every reduced shard already landed, so
  /// that units step while later reductions are still on the link.
  void deliver_landed_shards();
  void reduce(Unit& unit);           // flatten, hand to the reducer (in reduce_order_)
  void note_transient_bytes();
  /// Whether `unit` keeps its parameters gathered after forward ([Note: last unit stays gathered]).
  bool keeps_gathered_after_forward(const Unit& unit) const {
    return std::find(kept_after_forward_.begin(), kept_after_forward_.end(), &unit) != kept_after_forward_.end();
  }

  // [Note: prefetch]
  bool may_prefetch(const Unit& current) const;
  void prefetch_forward(const Unit& current);  // after `current` is unsharded
  void prefetch_backward(const Unit& current);
  void release_stray_prefetches();

  CommContext comm_;
  ResolvedOptions options_;
  std::shared_ptr<Tracer> tracer_;
  // Up to eight idle blocks. In backward four are live at once (a unit's gathered
  // parameters, the next unit's prefetch, the flat gradient being built and the one
  // in flight), and units of different sizes need blocks of their own (a request
  // takes no block twice its size): with four, the transformer bench model (units of
  // 0.8, 2.4 and 0.01 MB) dropped and re-reserved three blocks every step. The pool
  // never holds more blocks than were live together, or ones too large to reuse.
  memory::BufferPool pool_{8, int64_t(256) << 10};

  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<std::unique_ptr<CallSite>> call_sites_;
  std::vector<Unit*> implicit_units_;
  std::vector<Unit*> entry_units_;

  // Per-iteration schedule ([Note: collective order]).
  std::vector<Unit*> pre_forward_order_;
  std::vector<Unit*> post_forward_order_;
  std::vector<Unit*> backward_gather_order_;  // reverse post-forward
  std::vector<Unit*> reduce_order_;           // reverse pre-forward
  size_t gather_ptr_ = 0, reduce_ptr_ = 0;
  std::unique_ptr<GradReducer> reducer_;  // buckets and reductions in flight
  bool backward_planned_ = false;
  bool callback_queued_ = false;
  // After the units: destroyed before them, with the in-backward optimizer that steps them.
  StepPolicy policy_;
  std::vector<const Unit*> kept_after_forward_;  // from the previous iteration's forward
  std::vector<Unit*> recorded_forward_order_;  // pre-forward order of the last training forward

  int64_t peak_transient_ = 0;
  BoundaryObserver observer_;
  void observe(const Unit& unit, const char* phase) {
    if (observer_) observer_(unit.path(), phase);
  }
};

}  // namespace fsdp::core::detail
