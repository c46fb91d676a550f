#pragma once
/// FullyShardedDataParallel: the module wrapper users train with.
///
///     auto pg    = fsdp::comm::init_process_group();
///     auto model = fsdp::FullyShardedDataParallel(MyNet(cfg), pg,
///                    fsdp::Options().auto_wrap_policy(fsdp::size_based_policy(1e6)));
///     torch::optim::AdamW opt(model->parameters(), 1e-3);
///     auto loss = torch::mse_loss(model->forward(x), y);  loss.backward();  opt.step();
///
/// After wrapping, `named_parameters()` returns the model's own parameters under
/// their original names. Outside forward/backward each is this rank's 1-D piece of
/// itself (possibly empty; full shape under NO_SHARD) and so is its gradient, so any
/// torch::optim optimizer built on them trains the sharded model. A parameter's
/// TensorImpl never changes, so optimizer state keyed by it stays valid.
/// Units: see [Note: wrap candidates] in wrappable.h.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/comm/process_group.h"
#include "fsdp/core/options.h"
#include "fsdp/core/trace.h"
#include "fsdp/core/wrappable.h"
#include "fsdp/core/state_dict_type.h"

namespace torch::optim {
class Optimizer;
}

namespace fsdp {

namespace core::detail {
class Runtime;
class StateView;
class Unit;
struct ResolvedOptions;
struct SequentialSlot;
}  // namespace core::detail

/// Type-independent part of the wrapper (all the machinery lives here).
class FullyShardedBase : public torch::nn::Module {
 public:
  FullyShardedBase(std::shared_ptr<torch::nn::Module> model, comm::ProcessGroup pg, Options options);
  ~FullyShardedBase() override;

  const Options& options() const { return options_; }
  const comm::ProcessGroup& process_group() const { return pg_; }
  std::shared_ptr<torch::nn::Module> module_ptr() const { return model_; }

  /// Module paths of the units, root first ("" is the root).
  std::vector<std::string> unit_paths() const;
  /// Fully qualified names of the parameters of unit i.
  std::vector<std::string> unit_parameter_names(size_t i) const;

  /// Bytes this rank holds (see MemoryStats).
  MemoryStats memory_stats() const;
  void reset_peak_memory_stats();
  /// Releases the freed transient buffers FSDP keeps for reuse (MemoryStats::cached_bytes).
  void empty_cache();
  /// Paths of the units Options::gpu_margin_mem_ratio moved back to the compute device, in
  /// the order backward reduces them (empty before the first backward that stepped).
  std::vector<std::string> units_placed_on_device() const;

  /// Called at every unit boundary with the unit's path and the phase
  /// ("pre_forward", "post_forward", "pre_backward", "post_backward"); empty
  /// function: none. Used by fsdp::MemoryTracer (fsdp/core/memory_tracer.h).
  void set_unit_boundary_observer(std::function<void(const std::string& unit, const char* phase)> observer);

  /// Schedule trace (fsdp/trace.h), when enabled by Options::trace_dir or
  /// FSDP_TRACE: the spans recorded so far on this rank, writing them to
  /// <dir>/trace_rank<global rank>.json (returns the path; "" when disabled),
  /// and dropping them.
  std::vector<TraceSpan> trace_spans() const;
  std::string flush_trace();
  void clear_trace();

  /// Clips the global gradient norm over all ranks, each element counted once
  /// (under HYBRID_SHARD the norm is reduced over the shard group only: the
  /// replica groups hold identical gradients).
  /// norm_type: any p > 0, or infinity. Returns the total norm before clipping.
  /// Collective: every rank calls it. Refused under Options::optimizer_in_backward
  /// (each unit was stepped before the norm of all gradients existed).
  at::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0);

  /// Within its scope, backward accumulates unreduced gradients locally (under
  /// FULL_SHARD and SHARD_GRAD_OP: full unsharded gradients per unit, i.e. the
  /// memory of an unsharded model's gradients); the first backward after it
  /// reduces them together with its own.
  /// Returned by value, as torch::NoGradGuard: `auto guard = model->no_sync();`. Movable
  /// (a moved-from guard restores nothing), not copyable, not assignable.
  class [[nodiscard]] NoSyncGuard {
   public:
    explicit NoSyncGuard(FullyShardedBase* m);
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept : m_(other.m_), previous_(other.previous_) { other.m_ = nullptr; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    FullyShardedBase* m_;
    bool previous_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(this); }

  /// Options::optimizer_in_backward: `optimizer` steps each unit's shard inside
  /// backward, as its reduction completes ([Note: optimizer in backward] in
  /// src/core/backward_optimizer.h). Every parameter of it must be a trainable
  /// parameter of this model's units; LBFGS is refused. It must outlive the model or
  /// be replaced by another call first. Call before the first training forward.
  void register_optimizer_in_backward(torch::optim::Optimizer& optimizer);

  /// Options::optimizer_in_backward, gradient accumulation without no_sync: within its
  /// scope backward reduces as usual but does not step (gradient pieces accumulate as
  /// without the option); the first backward after it, the last micro-batch, steps
  /// with their sum. Under no_sync nothing is reduced, so nothing steps either.
  /// By value, as NoSyncGuard.
  class [[nodiscard]] NoStepGuard {
   public:
    explicit NoStepGuard(FullyShardedBase* m);
    ~NoStepGuard();
    NoStepGuard(NoStepGuard&& other) noexcept : m_(other.m_), previous_(other.previous_) { other.m_ = nullptr; }
    NoStepGuard(const NoStepGuard&) = delete;
    NoStepGuard& operator=(const NoStepGuard&) = delete;
    NoStepGuard& operator=(NoStepGuard&&) = delete;

   private:
    FullyShardedBase* m_;
    bool previous_;
  };
  NoStepGuard no_step() { return NoStepGuard(this); }

  // Module calls that would break sharding are rejected with the alternative.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  void pretty_print(std::ostream& stream) const override;
  /// Sets the mode of the user's root module as well: the wrapper registers only its
  /// children, so torch's Module::train alone would leave the root in the old mode.
  void train(bool on = true) override;

 protected:
  void root_pre_forward();
  void root_post_forward(const std::vector<at::Tensor>& outputs);
  /// Inside a catch of the wrapped forward's exception `e`: rethrows it, explained when an
  /// entry unit was not called through fsdp::call.
  [[noreturn]] void rethrow_forward_failure(const std::exception& e) const;
  std::optional<at::ScalarType> root_input_dtype() const { return root_input_dtype_; }

 private:
  // The state layer (state dicts, SummonFullParams, checkpoints) sees the units
  // only through this view (src/core/state_view.h).
  friend class core::detail::StateView;

  // The constructor's phases that need the wrapper itself, in order (the others are
  // free functions in fully_sharded.cpp).
  core::detail::ResolvedOptions validate() const;
  void register_children();
  void build_units(const core::detail::ResolvedOptions& resolved);

  std::shared_ptr<torch::nn::Module> model_;
  comm::ProcessGroup pg_;
  Options options_;
  std::unique_ptr<core::detail::Runtime> runtime_;
  core::detail::Unit* root_unit_ = nullptr;
  std::vector<std::unique_ptr<core::detail::SequentialSlot>> sequential_slots_;
  std::vector<WrappableBase*> wrappables_;
  std::vector<const torch::nn::Module*> called_entries_;  // fsdp::call's entries that are units
  std::optional<at::ScalarType> root_input_dtype_;
  core::detail::StateDictSelection state_dict_selection_;  // set by StateDictTypeGuard
};

template <typename Impl>
class FullyShardedDataParallelImpl : public FullyShardedBase {
 public:
  FullyShardedDataParallelImpl(std::shared_ptr<Impl> model, comm::ProcessGroup pg, Options options = {})
      : FullyShardedBase(model, std::move(pg), std::move(options)), typed_(std::move(model)) {}
  FullyShardedDataParallelImpl(torch::nn::ModuleHolder<Impl> model, comm::ProcessGroup pg, Options options = {})
      : FullyShardedDataParallelImpl(model.ptr(), std::move(pg), std::move(options)) {}

  /// Calls the wrapped model's forward between the root unit's hooks.
  template <typename... Args>
  auto forward(Args&&... args) {
    root_pre_forward();
    auto out = [&] {
      try {
        return typed_->forward(core::detail::cast_forward_input(std::forward<Args>(args), root_input_dtype())...);
      } catch (const std::exception& e) {
        rethrow_forward_failure(e);
      }
    }();
    std::vector<at::Tensor> tensors;
    core::detail::collect_tensors(out, tensors);
    root_post_forward(tensors);
    return out;
  }

  /// The wrapped model (its parameters are the sharded ones).
  const std::shared_ptr<Impl>& module() const { return typed_; }

 private:
  std::shared_ptr<Impl> typed_;
};

/// Module holder: `fsdp::FullyShardedDataParallel(MyNet(cfg), pg, options)`.
template <typename Impl>
class FullyShardedDataParallel : public torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Impl>> {
 public:
  using Base = torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Impl>>;
  using Base::Base;
  FullyShardedDataParallel(torch::nn::ModuleHolder<Impl> model, comm::ProcessGroup pg, Options options = {})
      : Base(std::make_shared<FullyShardedDataParallelImpl<Impl>>(model.ptr(), std::move(pg),
                                                                  std::move(options))) {}
  FullyShardedDataParallel(std::shared_ptr<Impl> model, comm::ProcessGroup pg, Options options = {})
      : Base(std::make_shared<FullyShardedDataParallelImpl<Impl>>(std::move(model), std::move(pg),
                                                                  std::move(options))) {}
};

template <typename Impl>
FullyShardedDataParallel(torch::nn::ModuleHolder<Impl>, comm::ProcessGroup, Options)
    -> FullyShardedDataParallel<Impl>;
template <typename Impl>
FullyShardedDataParallel(torch::nn::ModuleHolder<Impl>, comm::ProcessGroup)
    -> FullyShardedDataParallel<Impl>;
template <typename Impl>
FullyShardedDataParallel(std::shared_ptr<Impl>, comm::ProcessGroup, Options)
    -> FullyShardedDataParallel<Impl>;

}  // namespace fsdp
