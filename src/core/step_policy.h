#pragma once
// What one FullyShardedDataParallel root's backward does about the optimizer step:
// whether it reduces at all (no_sync), whether it steps each unit's shard as its
// reduction arrives ([Note: optimizer in backward] in backward_optimizer.h; no_step holds
// that back for accumulation), and where the stepped state lives after the first step
// that stepped ([Note: auto placement] in src/engine/placement.h). The schedule
// (runtime.h) asks; the policy answers and steps.

#include <memory>
#include <vector>

#include "backward_optimizer.h"
#include "fsdp/core/trace.h"
#include "resolved_options.h"

namespace fsdp::core::detail {

class Unit;

class StepPolicy {
 public:
  explicit StepPolicy(const ResolvedOptions& options);

  /// no_sync: backward accumulates gradients without reducing them.
  void set_no_sync(bool v) { no_sync_ = v; }
  bool no_sync() const { return no_sync_; }
  /// Backward reduces but does not step (more micro-batches follow).
  void set_no_step(bool v) { no_step_ = v; }
  bool no_step() const { return no_step_; }

  /// Options::optimizer_in_backward, and the optimizer registered for it.
  bool optimizer_in_backward() const { return optimizer_in_backward_; }
  void set_backward_optimizer(std::unique_ptr<BackwardOptimizer> optimizer) {
    backward_optimizer_ = std::move(optimizer);
  }
  /// Before a training forward: optimizer_in_backward needs a registered optimizer.
  void check_registered(int rank) const;

  /// Whether each final reduction is stepped on arrival (under no_sync none arrives).
  bool steps_reduced_shards() const { return backward_optimizer_ && !no_step_; }
  /// Whether this backward steps: reductions arrive and are stepped.
  bool steps_in_backward() const { return steps_reduced_shards() && !no_sync_; }
  /// Steps `unit`'s reduced shard, traced as "step".
  void step(Unit& unit, Tracer* tracer);
  /// The end of backward waits for the host thread's steps (traced as "host_steps").
  void wait_for_host_steps(Tracer& tracer);

  /// Options::gpu_margin_mem_ratio: once, at the end of the first backward that stepped,
  /// of the units in `reduce_order`.
  void place_after_warmup(const std::vector<Unit*>& reduce_order);
  /// Units placement moved back to the compute device (in reduce order).
  const std::vector<Unit*>& placed_on_device() const { return placed_on_device_; }

 private:
  bool optimizer_in_backward_;
  double gpu_margin_mem_ratio_;
  bool no_sync_ = false;
  bool no_step_ = false;
  std::unique_ptr<BackwardOptimizer> backward_optimizer_;
  bool placed_ = false;  // [Note: auto placement] in src/engine/placement.h
  std::vector<Unit*> placed_on_device_;
};

}  // namespace fsdp::core::detail
