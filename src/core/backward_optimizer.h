#pragma once
// The user's optimizer, stepped inside backward (Options::optimizer_in_backward).
//
// [Note: optimizer in backward]
// Each unit's shard is stepped the moment its final reduction of the iteration
// arrives (Runtime::on_shard_reduced), by the user's own optimizer object: one
// optimizer, not one per parameter, so its state, state dicts and checkpoints are
// exactly those of stepping after backward. A step sees only this unit's
// parameters: the optimizer's groups are narrowed to them for its duration, so no
// other gradient (autograd's, of units still to be reduced; pieces of units not in
// this backward) is read, and torch optimizers skip parameters without one. Each
// parameter is therefore stepped exactly once per iteration, with exactly the
// gradient piece it would have after backward; per-parameter updates (SGD, Adam,
// AdamW, CPUAdam, ...) make that bitwise equal to one step after backward. The
// pieces are freed after the step, so backward holds the reduced shards of the
// units in flight instead of the whole model's. Optimizers that need every
// gradient at once (a closure, LBFGS) cannot work this way and are refused; so
// are the things that read every gradient before a step (global-norm clipping,
// the loss scaler's inf check), at the call that would do them.
//
// A reduction arrives when the reducer delivers it: when the reducer waits for it
// (making room for the next one, or at the end of backward), or earlier, when a
// unit's backward hook finds it already complete without waiting
// (Runtime::deliver_landed_shards). That lets HYBRID_SHARD step a unit while the
// replica all-reduces after it are still on the slow link; a transport that moves
// data only while waited on (shared memory) delivers at the waits alone.
//
// A reduction is final unless the caller said that more micro-batches follow:
// under no_sync nothing is reduced, and FullyShardedBase::no_step() holds the
// step back for accumulation without no_sync.
//
// With Options::cpu_offload the steps run on a host thread while backward goes
// on ([Note: host steps] in src/engine/host_step_queue.h); the end of backward waits
// for them. A step there narrows the optimizer's groups to the unit's parameters, so
// it reads no gradient but its own. A unit placement "auto" moved back to the device
// (Options::gpu_margin_mem_ratio) steps on the backward thread, once the host steps
// posted before it have run. ZeRO keeps the same contract ([Note: stepping in
// backward] in src/engine/in_backward_steps.h).

#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "engine/in_backward_steps.h"

namespace torch::optim {
class Optimizer;
}

namespace fsdp::core::detail {

class Unit;

class BackwardOptimizer {
 public:
  /// Checks `optimizer` against the units (every parameter a trainable parameter of
  /// one of them, no closure-driven optimizer) and keeps a reference to it. A tied
  /// parameter listed under each of its names (model->parameters() does so) is stepped
  /// once per listing, inside backward as after it.
  /// on_host_thread: steps run on a thread of their own (cpu_offload).
  BackwardOptimizer(torch::optim::Optimizer& optimizer, const std::vector<Unit*>& units, int rank,
                    bool on_host_thread);
  ~BackwardOptimizer();

  /// Steps `unit`'s shard with its reduced gradient pieces (Unit::step_reduced_shard),
  /// the optimizer's groups narrowed to the unit's parameters meanwhile: on the host
  /// thread where it is offloaded and there is one, now otherwise.
  void step(Unit& unit);
  /// Returns once every posted step has run; rethrows the first error one threw.
  void drain() { steps_.drain(); }

  const torch::optim::Optimizer& optimizer() const { return optimizer_; }
  /// Offloaded units step on a thread of their own.
  bool on_host_thread() const { return steps_.on_host_thread(); }

 private:
  void step_now(Unit& unit);

  torch::optim::Optimizer& optimizer_;
  engine::InBackwardSteps steps_;  // last: destroyed (its steps finished) first
};

}  // namespace fsdp::core::detail
