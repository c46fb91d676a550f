#pragma once
// A unit: the parameters that are gathered, computed with and reduced together
// (FSDP2's FSDPParamGroup). It owns one FlatParameter and the unit's training
// state machine; the Runtime (runtime.h) decides when collectives are issued so
// that every rank issues them in the same order.
//
// [Note: unit training states]
//   IDLE            sharded; parameters point at their pieces; gradients are pieces
//   FORWARD         unsharded, inside forward
//   AWAIT_BACKWARD  forward done with grad enabled; unsharded views kept (storage
//                   freed when resharding after forward)
//   BACKWARD        re-gathered for backward (or never freed)
//   REDUCING        gradients flattened; handed to the GradReducer (or accumulated
//                   under no_sync); the reduced shard arrives by the end of backward
// IDLE -> FORWARD -> AWAIT_BACKWARD -> BACKWARD -> REDUCING -> IDLE, and
// FORWARD -> IDLE for a forward under NoGradGuard. Any hook that runs in a
// state it does not expect fails with both states.

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "flat_param.h"
#include "fsdp/dist/collectives.h"
#include "fsdp/fsdp/trace.h"
#include "fsdp/fsdp/wrappable.h"

namespace torch::autograd {
struct Node;
}

namespace fsdp::detail {

class Runtime;

enum class UnitState { IDLE, FORWARD, AWAIT_BACKWARD, BACKWARD, REDUCING };
const char* to_string(UnitState s);

class Unit : public UnitHooks {
 public:
  Unit(Runtime* runtime, int index, std::string path, std::unique_ptr<FlatParameter> flat,
       bool is_root, bool reshard_after_forward);

  // UnitHooks: the call site's interception points.
  void pre_forward() override;
  void post_forward(const std::vector<at::Tensor>& outputs) override;
  std::optional<at::ScalarType> forward_input_dtype() const override;

  // Driven by the Runtime.
  void on_output_grad();               // output hook: this unit's backward is next
  void stash_grads();                  // backward starts: move earlier gradient pieces aside
  void on_param_grad(size_t entry);    // AccumulateGrad post hook
  bool grads_complete() const { return fired_ == num_grad_params_; }
  bool has_grad_params() const { return num_grad_params_ > 0; }
  bool needs_backward_gather() const;
  void gather();                       // alloc + all-gather (blocking)
  void issue_gather();                 // alloc + start the all-gather (no-op if allocated)
  void wait_gather();                  // complete an issued all-gather (no-op otherwise)
  bool gather_pending() const { return gather_pending_; }
  void enter_backward();               // AWAIT_BACKWARD -> BACKWARD (no-op otherwise)
  // Gradient reduction ([Note: reduce buckets] in reduce_bucket.h): the unit
  // flattens its gradients, the GradReducer reduces them (alone or in a bucket)
  // and hands back this rank's reduced shard.
  bool flatten_grads(bool no_sync);    // -> REDUCING; true: flat_grad() awaits reduction
  const at::Tensor& flat_grad() const { return flat_grad_; }
  at::Tensor take_flat_grad();         // the reducer takes (and later frees) it
  void adopt_reduced_shard(at::Tensor shard);  // completed reduction: divide, cast, keep
  void finish_iteration();             // assign gradient pieces, reshard
  std::string label() const { return path_.empty() ? "<root>" : path_; }
  void reset_after_abandoned_forward();

  int index() const { return index_; }
  bool is_root() const { return is_root_; }
  const std::string& path() const { return path_; }
  UnitState state() const { return state_; }
  FlatParameter& flat() { return *flat_; }
  const FlatParameter& flat() const { return *flat_; }
  int64_t transient_bytes() const;     // unsharded params + flat grads in flight + no_sync grads
  int64_t grad_piece_bytes() const;

 private:
  void expect_state(std::initializer_list<UnitState> allowed, const char* where) const;
  void unshard();
  void ensure_grad_accumulators();
  void free_unsharded();               // waits for an in-flight gather first
  std::string trace_name(const char* what) const;

  Runtime* runtime_;
  int index_;
  std::string path_;
  std::unique_ptr<FlatParameter> flat_;
  bool is_root_;
  bool reshard_after_forward_;
  UnitState state_ = UnitState::IDLE;

  size_t num_grad_params_ = 0;
  bool has_frozen_params_ = false;
  std::vector<bool> fired_flags_;
  size_t fired_ = 0;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep hooks alive
  std::vector<at::Tensor> stashed_grads_;  // pieces from before this iteration
  bool stashed_ = false;

  at::Tensor flat_grad_;        // flattened, awaiting reduction (flat-sized)
  at::Tensor reduced_shard_;    // reduction output (shard-sized; may view a bucket's output)
  bool reduced_ready_ = false;   // reduced_shard_ holds this iteration's result
  at::Tensor no_sync_grad_;     // accumulated unsharded gradient under no_sync

  dist::CommHandle gather_handle_;
  at::Tensor gather_source_;     // the (possibly cast) shard being sent by an in-flight gather
  bool gather_pending_ = false;  // an all-gather into the unsharded buffer is in flight
  bool output_grad_seen_ = false;  // this iteration's first output hook has run
  // Open trace spans (fsdp/trace.h); no-ops unless tracing.
  Tracer::Mark gather_mark_, forward_mark_, backward_mark_;
};

}  // namespace fsdp::detail
