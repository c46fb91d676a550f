#pragma once
// A unit: the parameters that are gathered, computed with and reduced together
// (FSDP2's FSDPParamGroup). It owns one FlatParameter and the unit's lifecycle
// state. It knows nothing of the Runtime (runtime.h): the Runtime receives every
// hook (call site, autograd) and drives units through the primitives below, in
// the orders that keep every rank's collectives matched ([Note: collective
// order] in runtime.h). A unit only sees the narrow UnitContext.
//
// [Note: unit lifecycle]
// A unit moves only along these arrows, each checked by transition(); any other
// move fails naming the unit, its rank and both states.
//
//              begin_forward                   end_forward (grad)
//   IDLE ---------------------------> FORWARD ---------------------> AWAIT_BACKWARD
//    ^ ^                               |  ^                             |  |  |
//    | +-- end_forward (no grad) ------+  +-- begin_forward (again) ----+  |  | gather_ahead_
//    | +-- abandon_forward (from FORWARD or AWAIT_BACKWARD) ---------------+  | of_backward
//    |                                                                        v
//    |                                         BACKWARD <---------- GATHERED_FOR_BACKWARD
//    |                                          ^       begin_backward
//    |                                          +------ begin_backward (first output hook)
//    |                                                  from AWAIT_BACKWARD
//    |
//    |   AWAIT_BACKWARD, GATHERED_FOR_BACKWARD, BACKWARD
//    |      --flatten_grads--> REDUCING --adopt_reduced_shard--> REDUCED
//    |      --flatten_grads (no_sync)--> ACCUMULATED
//    |   REDUCED --step_reduced_shard--> STEPPED (optimizer in backward, final reduction)
//    |
//    +-- finish_iteration -- REDUCED, STEPPED, ACCUMULATED; AWAIT_BACKWARD, GATHERED_FOR_BACKWARD,
//                            BACKWARD (no gradient parameters); IDLE (ran again without grad)
//   Also FORWARD -> FORWARD: begin_forward inside the unit's own forward.
//
//   A recompute ([Note: recompute] in runtime.h): a checkpoint re-runs the unit's forward
//   inside backward. Its first forward ran without grad as a checkpointed forward and
//   took the arrows above as a forward with grad (-> AWAIT_BACKWARD).
//     AWAIT_BACKWARD, GATHERED_FOR_BACKWARD --begin_recompute--> RECOMPUTE
//        --end_recompute--> GATHERED_FOR_BACKWARD (its output hooks are armed now)
//     BACKWARD --begin_recompute--> RECOMPUTE --end_recompute--> BACKWARD (a unit whose
//        backward already started, e.g. also called outside the checkpoint)
//
//   IDLE                   sharded; parameters point at their pieces; gradients are pieces
//   FORWARD                unsharded, inside forward
//   AWAIT_BACKWARD         forward done with grad enabled; unsharded views kept (storage
//                          freed when resharding after forward)
//   GATHERED_FOR_BACKWARD  re-gathered (gather issued) ahead of its backward by the
//                          backward gather order or a prefetch; no output hook seen yet
//   BACKWARD               its first output hook ran: its gradients are being computed
//   RECOMPUTE              unsharded, its forward re-run by a checkpoint inside backward
//   REDUCING               gradients flattened and handed to the GradReducer
//   ACCUMULATED            gradients flattened into the no_sync accumulator (no reduction)
//   REDUCED                this iteration's reduced shard arrived (adopt_reduced_shard)
//   STEPPED                the optimizer stepped the shard with the reduced gradient pieces
//                          (Options::optimizer_in_backward) and they were freed: finish_iteration
//                          assigns no gradient. Only the shard was written; the unsharded views
//                          autograd may still read are another buffer, except where the shard is
//                          the unsharded buffer (NO_SHARD in full precision): there every node
//                          reading a parameter with a gradient has run before its AccumulateGrad
//                          (a node reading a detached alias of it is the exception; torch's
//                          optimizers then trip autograd's version check, CPUAdam's fused
//                          kernel writes through a raw pointer and would not).
// A unit whose parameters are all frozen has nothing to reduce: it stays in
// AWAIT_BACKWARD / GATHERED_FOR_BACKWARD / BACKWARD until finish_iteration.
// Two things stay data, not states: an all-gather in flight (a handle, also for
// a forward prefetch of an IDLE unit) and gradient pieces set aside at backward
// start (stash_grads); counters (gradients seen this iteration) and the backward
// state a recompute returns to are data too.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "autograd/grad_accumulator_handle.h"
#include "memory/buffer_pool.h"
#include "flat_param.h"
#include "gather_result.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/trace.h"
#include "resolved_options.h"
#include "stream_order.h"

namespace torch::autograd {
struct FunctionPostHook;
struct Node;
}  // namespace torch::autograd

namespace fsdp::core::detail {

enum class UnitState {
  kIdle,
  kForward,
  kAwaitBackward,
  kGatheredForBackward,
  kBackward,
  kRecompute,
  kReducing,
  kAccumulated,
  kReduced,
  kStepped,
};
const char* to_string(UnitState s);
/// The arrows of [Note: unit lifecycle].
bool unit_transition_allowed(UnitState from, UnitState to);

/// What a unit needs from its owner: owned by the Runtime, which outlives its units.
struct UnitContext {
  int rank = 0;                      // for error messages
  comm::ProcessGroup gather_group;   // all-gathers of the unsharded buffer
  memory::BufferPool* pool = nullptr;       // unsharded buffers and flat gradients ([Note: buffer pool])
  Tracer* tracer = nullptr;
  GradientDivision divide;           // applied before and after the reduction
  bool cast_forward_inputs = false;  // MixedPrecision::cast_forward_inputs
  StreamOrder* streams = nullptr;    // uses and waits ([Note: stream order wiring]); may be null
};

class Unit {
 public:
  /// Makes the AccumulateGrad post hook of entry i (installed by begin_forward).
  using GradHookFactory = std::function<std::unique_ptr<torch::autograd::FunctionPostHook>(size_t entry)>;

  Unit(UnitContext context, int index, std::string path, std::unique_ptr<FlatParameter> flat, bool is_root,
       bool reshard_after_forward);

  // ---- primitives, driven by the Runtime ----
  /// -> FORWARD: gathers (blocking) and points parameters at their full views;
  /// with grad, installs the gradient hooks. True if it allocated the buffer.
  bool begin_forward(bool training, const GradHookFactory& make_hook);
  void open_forward_span();
  /// Leaves FORWARD: -> AWAIT_BACKWARD with grad (freeing the gathered storage
  /// when resharding after forward, unless keep_gathered), -> IDLE without.
  void end_forward(bool training, bool keep_gathered);
  /// -> IDLE from a forward whose backward never comes; parameters and set-aside
  /// gradients go back as they were.
  void abandon_forward();
  /// An IDLE unit whose forward prefetch was not used: waits for it and frees it.
  void release_prefetch();

  /// Whether the parameters are not gathered: a forward prefetch or a backward
  /// gather must fetch them (false when never sharded or still gathered).
  bool needs_gather() const;
  // alloc + start the all-gather for `phase` (no-op if allocated); true: allocated
  bool issue_gather(comm::Phase phase);
  void wait_gather();                  // complete an issued all-gather (no-op otherwise)
  bool gather_pending() const { return pending_gather_.has_value(); }

  void stash_grads();                  // backward starts: move earlier gradient pieces aside
  /// AWAIT_BACKWARD -> GATHERED_FOR_BACKWARD, issuing its gather. True: allocated.
  bool gather_ahead_of_backward();
  /// -> BACKWARD at its first output hook: gathers if still needed, waits for the
  /// gather. True: allocated.
  bool begin_backward();
  void open_backward_span();
  /// -> RECOMPUTE ([Note: recompute] in runtime.h): gathers if still needed (the Runtime
  /// issued the gather in the backward order), waits, points parameters at their full
  /// views, installs the gradient hooks. True if it allocated the buffer.
  bool begin_recompute(const GradHookFactory& make_hook);
  /// Leaves RECOMPUTE for the backward state it came from (never frees the parameters:
  /// its backward comes next).
  void end_recompute();
  /// Whether forward ran with grad and the gradients are not flattened yet.
  bool awaits_reduction() const;
  /// AccumulateGrad wrote entry's gradient; true when this completes the unit's gradients.
  bool note_param_grad(size_t entry);
  bool grads_complete() const { return fired_ == num_grad_params_; }
  bool has_grad_params() const { return num_grad_params_ > 0; }

  // Gradient reduction ([Note: reduce buckets] in grad_reducer.h).
  /// -> REDUCING (flat_grad() awaits the reducer) or, under no_sync,
  /// -> ACCUMULATED. Only for units with gradient parameters.
  void flatten_grads(bool no_sync);
  const at::Tensor& flat_grad() const { return flat_grad_; }
  at::Tensor take_flat_grad();         // the reducer takes (and later frees) it
  void adopt_reduced_shard(at::Tensor shard);  // REDUCING -> REDUCED: divide, cast, keep
  /// REDUCED -> STEPPED: runs `step` while every gradient parameter points at its shard
  /// piece and holds its gradient piece (what finish_iteration would assign), then frees
  /// the pieces and points the parameters back at the views autograd knows.
  void step_reduced_shard(const std::function<void()>& step);
  void finish_iteration();             // -> IDLE: assign gradient pieces, reshard
  /// IDLE, offloaded: the shard (and any gradient pieces) move to the compute device for
  /// good ([Note: auto placement] in src/engine/placement.h).
  void place_shard_on_device();

  /// Mixed precision's forward input cast (UnitHooks::forward_input_dtype).
  std::optional<at::ScalarType> forward_input_dtype() const;

  // ---- read accessors ----
  int index() const { return index_; }
  bool is_root() const { return is_root_; }
  /// [Note: frozen companions] in runtime.h: the unit holding this call site's frozen
  /// parameters (null: none); its forward hooks run with this unit's.
  Unit* companion() const { return companion_; }
  void set_companion(Unit* frozen) { companion_ = frozen; }
  /// Throws, naming the parameter, when an entry's requires_grad differs from the one
  /// the unit was built with.
  void check_requires_grad_unchanged(int rank) const;
  const std::string& path() const { return path_; }
  std::string label() const { return path_.empty() ? "<root>" : path_; }
  UnitState state() const { return state_; }
  FlatParameter& flat() { return *flat_; }
  const FlatParameter& flat() const { return *flat_; }
  int64_t transient_bytes() const;     // unsharded params + flat grads in flight + no_sync grads
  /// Rethrows an out-of-memory error met making `what` of this unit (`bytes`, if known: > 0),
  /// naming the unit and the ways out; still a c10::OutOfMemoryError.
  [[noreturn]] void out_of_memory(const c10::OutOfMemoryError& e, const char* what, int64_t bytes) const;
  int64_t grad_piece_bytes() const;

 private:
  void transition(UnitState to, const char* event);
  void ensure_grad_accumulators(const GradHookFactory& make_hook);
  void free_unsharded();               // waits for an in-flight gather first
  // [Note: stream order wiring] in runtime.h: what this unit's buffers go through; each
  // returns at once when the stream order is off.
  StreamOrder* streams() const { return ctx_.streams && ctx_.streams->enabled() ? ctx_.streams : nullptr; }
  void order_compute_reads_unsharded();
  void reshard();                      // parameters back to their pieces, buffer freed
  void clear_iteration();
  /// Entry i's gradient piece of this iteration: the reduced shard's piece plus the
  /// piece set aside at backward start.
  at::Tensor reduced_grad_piece(size_t i) const;
  std::string trace_name(const char* what) const;

  UnitContext ctx_;
  int index_;
  std::string path_;
  std::unique_ptr<FlatParameter> flat_;
  bool is_root_;
  bool reshard_after_forward_;
  UnitState state_ = UnitState::kIdle;
  bool recompute_in_backward_ = false;  // RECOMPUTE was entered from BACKWARD

  size_t num_grad_params_ = 0;
  bool has_frozen_params_ = false;
  std::vector<bool> built_trainable_;  // each entry's requires_grad at construction
  Unit* companion_ = nullptr;
  std::vector<bool> fired_flags_;
  size_t fired_ = 0;
  std::vector<autograd::GradAccumulatorHandle> accumulators_;  // keep hooks alive
  // Pieces from before this iteration, set aside at backward start; nullopt: not set aside.
  std::optional<std::vector<at::Tensor>> stashed_grads_;

  at::Tensor flat_grad_;        // flattened, awaiting reduction (flat-sized)
  at::Tensor reduced_shard_;    // REDUCED: reduction output (shard-sized; may view a bucket's output)
  at::Tensor no_sync_grad_;     // accumulated unsharded gradient under no_sync

  std::optional<GatherResult> pending_gather_;  // an all-gather into the unsharded buffer in flight
  // Open trace spans (fsdp/trace.h); no-ops unless tracing.
  Tracer::Mark forward_mark_, backward_mark_, recompute_mark_;
};

}  // namespace fsdp::core::detail
