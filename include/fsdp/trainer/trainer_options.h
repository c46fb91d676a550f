#pragma once
/// Options of fsdp::trainer::Trainer (libtorch TORCH_ARG style: chained setters),
/// checked once, up front, on every rank by trainer_options_error.
///
///     auto o = fsdp::trainer::TrainerOptions()
///                  .strategy(fsdp::trainer::Strategy(fsdp::trainer::StrategyKind::kFullShard)
///                                .fsdp(fsdp::Options().auto_wrap_policy(
///                                    fsdp::module_type_policy<BlockImpl>())))
///                  .max_epochs(3).global_batch_size(64).accumulate_grad_batches(2)
///                  .gradient_clip_val(1.0).checkpoint_dir("ckpt").resume("auto")
///                  .devices(2);

#include <chrono>
#include <cstdint>
#include <string>

#include <c10/core/Device.h>
#include <torch/arg.h>

#include "fsdp/autograd/checkpoint_wrapper.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/options.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/safetensors.h"

namespace fsdp::trainer {

/// How the model is distributed: the family and, for FSDP, the sharding strategy.
enum class StrategyKind {
  kFsdp,          ///< FullyShardedDataParallel with Strategy::fsdp() exactly as given (its sharding_strategy included)
  kFullShard,     ///< FSDP with fsdp().sharding_strategy set to ShardingStrategy::kFullShard
  kShardGradOp,   ///< ... to kShardGradOp
  kHybridShard,   ///< ... to kHybridShard
  kNoShard,       ///< ... to kNoShard (DDP)
  kZero1,         ///< unwrapped model, ZeroRedundancyOptimizer stage 1 around the user's optimizer
  kZero2,         ///< the same, stage 2
  // The earlier spellings, kept deprecated (CHANGELOG.md, "Renamed").
  FSDP [[deprecated("use kFsdp")]] = kFsdp,
  FULL_SHARD [[deprecated("use kFullShard")]] = kFullShard,
  SHARD_GRAD_OP [[deprecated("use kShardGradOp")]] = kShardGradOp,
  HYBRID_SHARD [[deprecated("use kHybridShard")]] = kHybridShard,
  NO_SHARD [[deprecated("use kNoShard")]] = kNoShard,
  ZERO1 [[deprecated("use kZero1")]] = kZero1,
  ZERO2 [[deprecated("use kZero2")]] = kZero2,
};
/// "fsdp", "full_shard", "shard_grad_op", "hybrid_shard", "no_shard", "zero1", "zero2".
const char* to_string(StrategyKind kind);

/// A StrategyKind with the options of its family:
///  * FSDP kinds: FullyShardedDataParallel built with `fsdp()` (its sharding_strategy
///    replaced by the kind's, except under StrategyKind::kFsdp; see resolved_fsdp());
///  * kZero1, kZero2: the model stays unwrapped and the optimizer is a
///    fsdp::optim::ZeroRedundancyOptimizer of that stage around the user's optimizer,
///    with `zero()` (its process_group, stage, module and clip_grad_norm are set by the
///    Trainer).
///
///     using fsdp::trainer::Strategy, fsdp::trainer::StrategyKind;
///     Strategy s = StrategyKind::kZero2;                      // implicit
///     Strategy t = Strategy(StrategyKind::kFullShard).fsdp(fsdp::Options().bucket_cap_mb(25));
///     Strategy u = Strategy::parse("zero2");                  // a command line's word
struct Strategy {
  Strategy() = default;
  /* implicit */ Strategy(StrategyKind kind) : kind_(kind) {}
  /// The Strategy named `name` (to_string's words), for programs that take it from a
  /// command line or a file; an unknown name fails, listing the valid ones.
  static Strategy parse(const std::string& name);

  TORCH_ARG(fsdp::Options, fsdp) = {};
  TORCH_ARG(optim::ZeroOptions, zero) = {};
  /// FSDP strategies that shard parameters (full_shard, shard_grad_op,
  /// hybrid_shard): call the model factory inside an fsdp::ShardedInitContext, so that
  /// each fsdp::Wrappable the wrap policy picks is sharded as soon as it is built
  /// (Lightning's configure_sharded_model). false, no auto_wrap_policy (the model is
  /// then one unit) or TrainerOptions::device "cuda": build the whole model, then wrap.
  TORCH_ARG(bool, sharded_construction) = true;

 public:
  StrategyKind kind() const { return kind_; }
  /// to_string(kind()).
  std::string name() const { return to_string(kind_); }
  bool is_zero() const { return kind_ == StrategyKind::kZero1 || kind_ == StrategyKind::kZero2; }
  /// 1 or 2 under kZero1 / kZero2. Only for ZeRO kinds.
  int zero_stage() const;
  /// The FSDP options the strategy builds with (sharding_strategy from the kind).
  /// Only for FSDP kinds.
  fsdp::Options resolved_fsdp() const;

 private:
  StrategyKind kind_ = StrategyKind::kFullShard;
};

/// What happens to the samples left over when the dataset size is not a multiple
/// of the global batch size (see [Note: global batches] in global_sampler.h).
enum class LastBatch {
  kDrop,   ///< the last, short batch of an epoch is not trained on
  kShort,  ///< it is trained on: the loss is the mean over its samples, weighted by per-rank counts
};

struct TrainerOptions {
  TORCH_ARG(Strategy, strategy) = {};
  /// Optimizer steps to run in all, counted from the start of the run (a resumed run
  /// continues the count). 0: use max_epochs.
  TORCH_ARG(int64_t, max_steps) = 0;
  /// Passes over the training set when max_steps is 0.
  TORCH_ARG(int64_t, max_epochs) = 1;
  /// Samples per optimizer step, over all ranks and micro-batches. Must divide
  /// evenly into world size x accumulate_grad_batches.
  TORCH_ARG(int64_t, global_batch_size) = 32;
  /// Micro-batches per optimizer step (k): each holds global_batch_size / k samples;
  /// the loss of each is divided by k (weighted by counts for a short last batch),
  /// so k micro-batches give the gradient of one k-times-larger batch.
  /// FSDP strategies skip the reduction of the first k-1 (no_sync); zero1 reduces
  /// once in step(); zero2 reduces every micro-batch (its buckets allow no other).
  TORCH_ARG(int64_t, accumulate_grad_batches) = 1;
  /// Activation checkpointing: the checkpoint candidates of the model this policy accepts
  /// (e.g. fsdp::checkpoint_module_type<BlockImpl>()) recompute their forward in backward
  /// (fsdp::apply_activation_checkpointing on the factory's model, every strategy). Empty: off.
  TORCH_ARG(CheckpointPolicy, activation_checkpointing) = nullptr;
  /// Clip the global gradient norm (L2) to this before each step. 0: off.
  TORCH_ARG(double, gradient_clip_val) = 0.0;
  TORCH_ARG(LastBatch, last_batch) = LastBatch::kShort;
  /// Shuffle the training set each epoch with (seed, epoch).
  TORCH_ARG(bool, shuffle) = true;
  /// Seeds torch's CPU generator on every rank before the model factory runs (same
  /// initial weights everywhere) and the sampler's shuffle.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Run the validation step over the whole validation set every this many steps
  /// (0: only at the end of fit). Needs validation data and a validation step.
  TORCH_ARG(int64_t, val_check_interval) = 0;
  /// Samples per validation forward over all ranks. 0: global_batch_size.
  TORCH_ARG(int64_t, val_batch_size) = 0;
  /// Checkpoints go to `checkpoint_dir/step-S` (a directory every rank sees). Empty: none.
  TORCH_ARG(std::string, checkpoint_dir) = "";
  /// Save every this many steps, and after the last step. 0: only after the last step.
  TORCH_ARG(int64_t, checkpoint_interval) = 0;
  /// Keep only the newest K complete checkpoints (0 keeps all); rank 0 says on stderr
  /// each one it deletes.
  TORCH_ARG(int64_t, keep_checkpoints) = 2;
  /// A fresh run (not a resumed one) also saves the initial state as `step-0` before
  /// the first step, so a run that dies before its first checkpoint_interval resumes
  /// from the initial weights rather than starting afresh (fsdp-train does).
  TORCH_ARG(bool, checkpoint_at_start) = false;
  /// Save with fsdp::save_checkpoint_async (fsdp/state/async_checkpoint.h): training goes
  /// on while a writer thread writes; the checkpoint appears (and keep_checkpoints prunes,
  /// and Callback::on_checkpoint runs) at the first step boundary after it is written, and
  /// fit() waits for the last one. A failed save stops fit() with its error at the next
  /// step. false: every save blocks training until it is written.
  TORCH_ARG(bool, async_checkpoint) = true;
  /// "": start fresh. "auto": continue from the newest usable checkpoint under
  /// checkpoint_dir (none: start fresh). Otherwise a checkpoint directory to continue
  /// from, which fit() checks before it starts any rank (resume_path_error).
  TORCH_ARG(std::string, resume) = "";
  /// A fresh run (not a resumed one) starts from these weights: a safetensors file, a
  /// sharded set's index, or a directory holding either (fsdp::load_safetensors with
  /// init_options), or a PyTorch Distributed Checkpoint directory (its "model" weights:
  /// fsdp::load_dcp); after the model factory and before step-0 is saved. Empty: the
  /// factory's values.
  TORCH_ARG(std::string, init_from) = "";
  TORCH_ARG(SafetensorsLoadOptions, init_options) = {};
  /// After the last step, the weights go to this directory as safetensors
  /// (fsdp::save_safetensors with export_options: above 5 GB, a sharded set with its index,
  /// as transformers saves). With max_steps 0 and max_epochs 0 nothing trains: init_from
  /// is converted.
  TORCH_ARG(std::string, export_safetensors) = "";
  TORCH_ARG(SafetensorsSaveOptions, export_options) = SafetensorsSaveOptions().max_shard_bytes(5'000'000'000);
  /// JSON lines written by rank 0: one per step, one per validation (see metrics in trainer.h).
  TORCH_ARG(std::string, metrics_file) = "";
  /// A resumed run appends to metrics_file (the lines of the steps before the
  /// checkpoint stay; rank 0 says so on stderr). false: it truncates the file, which
  /// then holds this run's steps only (fsdp-train's --metrics; a restarted job then has
  /// no duplicate steps).
  TORCH_ARG(bool, metrics_append_on_resume) = true;
  /// The key validation lines of metrics_file hold their values under.
  TORCH_ARG(std::string, metrics_validation_key) = "validation";
  /// Rank 0 prints progress on stderr every log_every_n_steps steps (a bar on a terminal).
  TORCH_ARG(bool, progress) = true;
  TORCH_ARG(int64_t, log_every_n_steps) = 10;
  /// false (default): each step waits for the all-reduce of its own global loss, and
  /// on_step_end(s) runs before step s+1 starts, so a callback sees the model as step s
  /// left it. true: the all-reduce runs while the next step computes, off the critical
  /// path (across hosts it is a network round trip per step: ~10% of a step at 1 Gbit/s
  /// in docs/benchmarks.md); on_step_end, the metrics line and the progress report of
  /// step s then come after step s+1's optimizer step (still before any checkpoint or
  /// validation of step s, and all before fit returns). For runs whose callbacks only
  /// record metrics (fsdp-train sets it). See [Note: overlapped step loss] in
  /// step_loss_reduction.h.
  TORCH_ARG(bool, overlap_step_metrics) = false;
  /// Rank 0 prints the per-rank memory summary at the end of fit.
  TORCH_ARG(bool, memory_summary) = true;
  /// Ranks per node. 0: under a launcher, whatever it started; otherwise 1. Without a
  /// launcher, fit() with devices > 1 re-executes the program under fsdp-run (trainer.h).
  TORCH_ARG(int, devices) = 0;
  /// Nodes. > 1 needs a launcher on every node (fsdp-run --nnodes, torchrun, srun).
  TORCH_ARG(int, num_nodes) = 1;
  /// fsdp-run to re-execute under; empty: next to this executable, then the build and
  /// install directories of the library (the install directory first for a program
  /// compiled against the installed package), then PATH. Either way it must be the
  /// fsdp-run of this library's build ([Note: trainer launch] in launch.h).
  TORCH_ARG(std::string, launcher) = "";
  /// Rendezvous and collective timeout of the process group fit() creates.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// intra-op threads per rank (at::set_num_threads). 0: leave as is.
  TORCH_ARG(int, threads) = 0;
  /// Where each rank trains: "cpu", or "cuda" (the rank's GPU, ProcessGroup::cuda_device():
  /// its local rank modulo the visible GPUs unless the process group was told otherwise).
  /// Under "cuda" fit() moves the model the factory built to that GPU before wrapping it
  /// (FSDP) or building the ZeroRedundancyOptimizer over it, so the factory runs outside
  /// fsdp::ShardedInitContext there (Strategy::sharded_construction applies to "cpu" only:
  /// the model is built whole on the CPU first); moves each batch to the GPU before the
  /// training and validation steps (torch::data::Example<> by itself, another Batch type
  /// through Trainer::batch_to_device); and reports losses and metrics as host numbers, as
  /// on the CPU. Checkpoints hold host bytes either way: one saved on GPUs resumes on CPUs
  /// and the other way round. Checked up front: an unknown word by trainer_options_error,
  /// "cuda" on a machine without a usable GPU by device_error.
  TORCH_ARG(std::string, device) = "cpu";
};

/// What the Trainer was given besides the options, for trainer_options_error.
struct TrainerParts {
  bool model = false, optimizer = false, training_step = false;
  bool train_data = false, val_data = false, validation_step = false;
  bool validation_loop = false, batch_sampler = false;
  int64_t train_size = 0, val_size = 0;
  int64_t sampler_steps_per_epoch = 0;  ///< given with the batch sampler
  /// Batches can be moved to a device: the Batch type is torch::data::Example<>, or a
  /// Trainer::batch_to_device function was given (needed by device "cuda").
  bool batch_to_device = true;
};

/// Empty if `o` and `parts` can train at `world_size` ranks (0: not known yet, skip
/// the checks that need it); otherwise one message saying what is wrong and how to fix
/// it. Pure (no collective): every rank computes the same answer.
std::string trainer_options_error(const TrainerOptions& o, const TrainerParts& parts, int world_size);

/// Empty if `o.resume()` is "", "auto" or a directory holding a checkpoint; otherwise why
/// not and how to fix it. Reads the file system, so unlike trainer_options_error it is
/// not asked on every rank: fit() asks it in the process that starts the ranks, before
/// any starts (a rank that could not see the directory would otherwise fail alone).
std::string resume_path_error(const TrainerOptions& o);

/// Empty if `o.device()` can train on this machine; otherwise what is wrong and how to fix
/// it (an unknown word, or "cuda" where torch sees no CUDA device). Reads the machine, so
/// like resume_path_error it is not part of trainer_options_error: fit() asks it before any
/// rank starts and again on every rank (ranks may run on other machines).
std::string device_error(const TrainerOptions& o);

/// The device rank `pg.rank()` trains on under `o.device()`: the CPU, or the CUDA device
/// the process group bound (ProcessGroup::cuda_device()). Fails, naming the rank and the
/// fix, when "cuda" is asked of a group that moves no CUDA tensors (a rank without a GPU).
c10::Device training_device(const TrainerOptions& o, const comm::ProcessGroup& pg);

}  // namespace fsdp::trainer
