#pragma once
/// ZeRO-1 and ZeRO-2 for any torch::nn::Module: a sharded optimizer.
///
///     auto opt = fsdp::optim::ZeroRedundancyOptimizer(
///         model->parameters(),
///         fsdp::optim::inner_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-3)),
///         fsdp::optim::ZeroOptions().process_group(pg).stage(2));
///     for (...) {
///       opt.zero_grad();
///       torch::mse_loss(model->forward(x_local), y_local).backward();
///       opt.step();            // reduce, (clip,) step this rank's partition, all-gather
///     }
///
/// The model is not wrapped and needs no marks. Its trainable parameters keep their
/// TensorImpls but now view one flat buffer owned by the optimizer; between steps they
/// are full and identical on every rank (construction broadcasts them from rank 0).
/// Gradients are averaged over the group (each rank's loss is a mean over its share of
/// the global batch). Each rank's inner optimizer (any torch::optim optimizer but LBFGS,
/// or fsdp::optim::CPUAdam, built by the user's factory) steps only this rank's pieces of
/// the parameters; see [Note: ZeRO partition layout] in src/optim/zero_layout.h for the
/// layout, why it was chosen, and the traffic of each stage.
///
/// Stage 1 keeps gradients whole: backward is plain autograd (no hooks), and step()
/// reduces (so gradient accumulation costs no communication until the last
/// micro-batch). Stage1Reduction::kAllReduce (LowLevelZero / PyTorch
/// ZeroRedundancyOptimizer semantics, 3Ψ per step) leaves the averaged full gradients in
/// every parameter's grad(); kReduceScatter (DeepSpeed, 2Ψ) reduces only this rank's
/// chunks and leaves grad() as the local gradients.
///
/// Stage 2 reduces during backward: AccumulateGrad post hooks copy each gradient into its
/// bucket's buffer and free it; a full bucket is reduce-scattered into this rank's
/// gradient partition (accumulated over micro-batches: no implicit 1/k). After backward
/// every parameter's grad() is undefined. step() consumes the partition (as DeepSpeed
/// and ColossalAI do), so zero_grad() between steps is optional.
///
/// Parameter semantics as in PyTorch: a parameter whose gradient is undefined on every
/// rank (unused everywhere, or set to none) is skipped by the inner optimizer (one small
/// all-reduce per step finds them); frozen parameters (requires_grad false at
/// construction) are not partitioned and never stepped; each parameter group keeps its
/// own hyperparameters, and an LR scheduler acting on this optimizer's param_groups()
/// reaches the inner optimizer at the next step().
///
/// Loss scaling (LowLevelZero's facade): backward(loss) scales the loss; step() unscales
/// this rank's gradient pieces, and the same all-reduce that finds unused parameters and
/// the global norm tells every rank whether any rank saw inf/nan; then all skip the step.
///
/// State dicts: fsdp::consolidate_state_dict / load_consolidated_state_dict
/// (include/fsdp/state/zero_state_dict.h); checkpoint directories in FSDP's format,
/// loadable by FSDP and from FSDP at any world size: fsdp::save_checkpoint /
/// load_checkpoint (include/fsdp/state/zero_checkpoint.h). fsdp-train: --strategy
/// zero1 | zero2. fsdp::trainer::TrainingFacade drives this optimizer and FSDP models alike.
/// Stage 1 always defers the reduction to step(); reducing every micro-batch is not offered.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "fsdp/comm/process_group.h"
#include "fsdp/optim/group_options.h"
#include "fsdp/memory/memory_usage.h"
#include "fsdp/precision/grad_scaler.h"

namespace fsdp::optim {

/// Stage 1's reduction (see the header comment).
enum class Stage1Reduction { kAllReduce, kReduceScatter };

/// Options of ZeroRedundancyOptimizer (LowLevelZero's names), checked by its constructor.
struct ZeroOptions {
  /// The data-parallel group. Required.
  TORCH_ARG(comm::ProcessGroup, process_group) = {};
  /// 1: optimizer state sharded; 2: gradients too (LowLevelZero's partition_grad).
  TORCH_ARG(int, stage) = 1;
  TORCH_ARG(Stage1Reduction, stage1_reduction) = Stage1Reduction::kAllReduce;
  /// Elements per gradient bucket (LowLevelZero's default). Also the unit of the
  /// partition: see [Note: ZeRO partition layout].
  TORCH_ARG(int64_t, reduce_bucket_size) = 1024 * 1024;
  /// Keep up to two bucket collectives in flight (stage 2: the reductions during
  /// backward; both stages: stage 1's reductions and the all-gathers in step()) instead
  /// of waiting for each one as it is issued. Same results either way; one more bucket
  /// buffer alive.
  TORCH_ARG(bool, overlap_communication) = false;
  /// Global L2 norm (every element counted once) above which step() scales the
  /// gradients down, as torch::nn::utils::clip_grad_norm_. 0: off.
  TORCH_ARG(double, clip_grad_norm) = 0.0;
  /// dtype of gradient reductions (float, bfloat16, half). Default: the parameters'
  /// (param_dtype under mixed precision).
  TORCH_ARG(c10::optional<at::ScalarType>, communication_dtype) = c10::nullopt;
  /// Mixed precision: the parameters (fp32 at construction) are cast to this dtype
  /// (bfloat16; half where the device computes in it) for forward and backward, frozen
  /// ones too; this rank's partition is kept in fp32 as master weights, which the inner
  /// optimizer steps, and its reduced gradients are accumulated in fp32 (also at stage 1).
  /// After the step the masters are rounded into the parameters' own chunks and
  /// all-gathered in this dtype. Buffers keep their dtype.
  TORCH_ARG(c10::optional<at::ScalarType>, param_dtype) = c10::nullopt;
  /// The model, if given: names parameters in messages, orders them by registration,
  /// and its buffers are broadcast from rank 0 at construction.
  TORCH_ARG(std::shared_ptr<torch::nn::Module>, module) = nullptr;
  /// Broadcast the module's buffers (BatchNorm statistics) from rank 0 at every step.
  /// Needs `module`.
  TORCH_ARG(bool, sync_buffers) = false;
  /// Rank 0 prints the layout (buckets, partition sizes) at construction.
  TORCH_ARG(bool, verbose) = false;
  /// Dynamic loss scaling for backward(loss) / step(): unset (default) means a static
  /// scale of 1, what bf16 needs. LowLevelZero's defaults: low_level_zero_scaler().
  TORCH_ARG(c10::optional<precision::DynamicGradScalerOptions>, dynamic_loss_scale) = c10::nullopt;
  /// backward(loss) divides the loss by this (DeepSpeed's engine does so for
  /// gradient accumulation); a plain loss.backward() never is. >= 1.
  TORCH_ARG(int64_t, gradient_accumulation_steps) = 1;
  /// Stage 2 only: step each bucket's chunk of the partition inside backward, as soon as
  /// its reduce-scatter completes (one small all-reduce per bucket finds the parameters
  /// unused on every rank, which are skipped as after backward); step() then only
  /// all-gathers the parameters. Same results bit for bit as stepping in step(). Refused
  /// with clip_grad_norm and dynamic_loss_scale (both read every gradient before any step).
  /// Every backward steps, so call step() after each one, and wrap every micro-batch but
  /// the last of an accumulation in no_step().
  TORCH_ARG(bool, optimizer_in_backward) = false;
  /// ZeRO-Offload (LowLevelZero's cpu_offload, DeepSpeed's offload_optimizer): this
  /// rank's partition of the parameters in full precision (the masters the inner
  /// optimizer steps), the reduced gradients it steps with and so the optimizer state
  /// live in host memory, pinned when the parameters are on a GPU. The parameters stay
  /// where they are, in their compute dtype; gradients are reduced there as without
  /// offload, and this rank's reduced chunk is copied to the host before its step. Under
  /// optimizer_in_backward each bucket's chunk is copied as it completes and stepped on a
  /// host thread while backward goes on; step() waits for those steps ([Note: host steps]
  /// in src/memory/host_step_queue.h). After the step the updated chunks are copied back and
  /// all-gathered. Build the inner optimizer for host tensors:
  /// fsdp::optim::CPUAdam. Same values as without offload for the same inner optimizer
  /// (on a CPU-only machine host and device are one memory: the copies and the
  /// accounting still run). Every rank passes the same value.
  TORCH_ARG(bool, cpu_offload) = false;
  /// With cpu_offload, ColossalAI's "auto" placement: after the first step, this fraction
  /// of the device memory that step left unused at its peak (the device's memory times the
  /// caching allocator's memory fraction, minus its peak allocated bytes) takes back buckets'
  /// masters and optimizer state, which the inner optimizer then steps on the device
  /// (CPUAdam: with tensor ops there, its fused kernel on the host); the rest stay on the
  /// host. 0 (default): everything offloaded stays on the host; 1: as much as fits. Decided
  /// once. Needs the parameters on a CUDA device to move anything. See [Note: auto
  /// placement] in src/memory/placement.h.
  TORCH_ARG(double, gpu_margin_mem_ratio) = 0.0;

 public:
  /// LowLevelZero's scaler: initial 2^16, growth interval 2000, max 2^24, hysteresis 2.
  static precision::DynamicGradScalerOptions low_level_zero_scaler();
};

/// Builds the inner optimizer over this rank's pieces. It must keep the groups it is
/// given, in order (group i holds the pieces of the parameters of the user's group i,
/// possibly none, with that group's options if it had any).
using InnerOptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;

/// inner_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-3)): a factory
/// for any optimizer constructible as Opt(std::vector<OptimizerParamGroup>, OptOptions).
template <typename Opt, typename OptOptions>
InnerOptimizerFactory inner_optimizer(OptOptions defaults) {
  return [defaults](std::vector<torch::optim::OptimizerParamGroup> groups) {
    auto opt = std::unique_ptr<torch::optim::Optimizer>(new Opt(groups, defaults));
    keep_group_options(*opt, groups);
    return opt;
  };
}

class ZeroRedundancyOptimizer : public torch::optim::Optimizer {
 public:
  /// Collective over options.process_group(): every rank passes the same parameters in
  /// the same groups. Gradients already present are dropped.
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                          InnerOptimizerFactory make_inner, ZeroOptions options);
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, InnerOptimizerFactory make_inner,
                          ZeroOptions options);
  ~ZeroRedundancyOptimizer() override;
  ZeroRedundancyOptimizer(ZeroRedundancyOptimizer&&) = delete;

  /// Reduces (stage 1), finds parameters without a gradient anywhere, clips, steps this
  /// rank's pieces, all-gathers the updated parameters. Collective. With a closure, calls
  /// it first (it runs forward and backward) and returns its loss.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// The end of step(): rounds this rank's pieces (their fp32 masters under mixed
  /// precision) into its chunks of the parameters and all-gathers every rank's chunks
  /// into every parameter. Collective. For code that wrote the pieces (local_pieces())
  /// directly, such as fsdp::load_checkpoint.
  void all_gather_parameters();
  /// LowLevelZero's call pattern: (loss * scale / gradient_accumulation_steps).backward().
  void backward(const torch::Tensor& loss);
  /// Whether the last step() updated the parameters: false when a rank found inf/nan in
  /// the unscaled gradients (every rank then skips: parameters and optimizer state
  /// unchanged, the gradients discarded, the scaler backs off per its hysteresis).
  bool last_step_applied() const;
  /// The loss scale backward() applies next (1 without dynamic_loss_scale).
  double loss_scale() const;
  /// The dynamic scaler's state (scale, growth and hysteresis counters), for checkpoints.
  precision::GradScalerState loss_scaler_state() const;
  void load_loss_scaler_state(const precision::GradScalerState& state);

  /// Hides torch::optim::Optimizer::zero_grad(bool), which is not virtual: call it on this
  /// class. Stage 1: as torch's (set_to_none resets grad(), else zeroes it in place);
  /// stage 2: also clears the gradient partition (set_to_none) or zeroes it.
  void zero_grad(bool set_to_none = true);

  /// ZeroOptions::optimizer_in_backward: within its scope backward reduces (gradients
  /// accumulate in the partition) but steps nothing; the first backward after it steps.
  /// A step() after a backward that stepped nothing steps as without the option.
  /// Returned by value, as torch::NoGradGuard: `auto guard = opt.no_step();`. Movable
  /// (a moved-from guard restores nothing), not copyable, not assignable.
  class [[nodiscard]] NoStepGuard {
   public:
    explicit NoStepGuard(ZeroRedundancyOptimizer* opt);
    ~NoStepGuard();
    NoStepGuard(NoStepGuard&& other) noexcept : opt_(other.opt_), previous_(other.previous_) { other.opt_ = nullptr; }
    NoStepGuard(const NoStepGuard&) = delete;
    NoStepGuard& operator=(const NoStepGuard&) = delete;
    NoStepGuard& operator=(NoStepGuard&&) = delete;

   private:
    ZeroRedundancyOptimizer* opt_;
    bool previous_;
  };
  NoStepGuard no_step() { return NoStepGuard(this); }

  /// Refused (each rank's state covers only its pieces): use fsdp::consolidate_state_dict.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const ZeroOptions& options() const;
  /// The optimizer that steps this rank's pieces.
  torch::optim::Optimizer& inner();
  /// Global gradient norm found by the last step() (before clipping), or -1 when that
  /// step did not compute one (clipping off).
  double last_grad_norm() const;
  /// Bytes this rank holds, by category: parameters (full replicas, and frozen ones),
  /// gradients (stage 1: grad() tensors; stage 2: the partition and buckets in flight),
  /// fp32 master partition (mixed precision), optimizer state (the tensors of Adam,
  /// AdamW, CPUAdam, SGD, Adagrad and RMSprop states; other state classes count 0),
  /// and other: the freed bucket buffers kept for the next step (at most four buckets
  /// per stage-1 step or stage-2 backward), which empty_cache() releases. Under
  /// cpu_offload the masters, the optimizer state and the host copy of the reduced
  /// gradients are in host memory: MemoryUsage::offloaded_bytes.
  MemoryUsage get_memory_usage() const;
  /// Releases the freed bucket buffers kept for the next step (MemoryCategory::kOther
  /// in get_memory_usage()); the next step allocates them again.
  void empty_cache();

  /// Layout facts ([Note: ZeRO partition layout]).
  int64_t flat_numel() const;
  int64_t partition_numel() const;
  int num_buckets() const;
  /// gpu_margin_mem_ratio: how many buckets' masters and optimizer state were moved back to
  /// the device (0 before the first step).
  int num_buckets_on_device() const;

  /// For the state layer (include/fsdp/state/zero_state_dict.h). A trainable parameter:
  /// its name in options().module() ("" without a module) and its index in
  /// param_groups(). Listed in flat order.
  struct TrainableParam {
    std::string name;
    torch::Tensor param;
    int group = 0;
  };
  std::vector<TrainableParam> trainable_parameters() const;
  /// One of this rank's pieces: elements [offset, offset + numel) of the flattened
  /// trainable parameter `param` (index into trainable_parameters()), stepped by inner()
  /// as the 1-D tensor `tensor`.
  struct LocalPiece {
    int param = 0;
    int64_t offset = 0;
    int64_t numel = 0;
    torch::Tensor tensor;
  };
  std::vector<LocalPiece> local_pieces() const;

 private:
  struct Impl;
  void construct(std::vector<torch::optim::OptimizerParamGroup> param_groups, InnerOptimizerFactory make_inner);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::optim
