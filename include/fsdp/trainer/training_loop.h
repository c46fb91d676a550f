#pragma once
/// The training loop of fsdp::trainer::Trainer (sampling, accumulation, clipping,
/// stepping, validation, checkpoints, resume, metrics, progress, memory summary),
/// compiled once into the library, and its public entry point for programs that build
/// the model and the optimizer themselves.
///
/// Trainer<Impl> builds the model and the optimizer with the user's types and calls
/// run_training_loop with them as a LoopModel; the datasets and the user's steps
/// arrive as functions of sample indices (LoopData). A program that needs what the
/// Trainer does not offer (a model built its own way, its own data order, evaluation
/// and resume check, its own name on the loop's messages: fsdp-train) calls
/// run_training_loop directly.
///
/// The contract of run_training_loop:
///  * collective over `pg`: every rank calls it with the same options, the same kind
///    of model (the same strategy) and the same data sizes and hooks;
///  * the options must have passed trainer_options_error (the loop checks only what
///    depends on the hooks' answers: a batch sampler's empty batch, a training step's
///    non-scalar loss, validation keys that differ between batches);
///  * `model` is ready to train: the FSDP wrapper and an optimizer over its
///    parameters, or a ZeroRedundancyOptimizer over the unwrapped model. The loop uses
///    them only through train()/eval() of the module, zero_grad/step of the optimizer
///    (and its groups' learning rates: read for the metrics, reset while a resumed
///    scheduler is replayed), step of the scheduler, no_sync and clip_grad_norm_ of the
///    FSDP wrapper, and fsdp::save_checkpoint / load_checkpoint. Strategy and model
///    must agree: the loop reads Strategy only for the memory summary;
///  * TrainerOptions::seed orders the samples (GlobalSampler) and is recorded in
///    checkpoints; seeding the model's construction (identical initial weights on every
///    rank) is the caller's, as are TrainerOptions::threads, devices, num_nodes,
///    launcher and timeout (the process group is made);
///  * the hooks run on every rank, in the same order, between the loop's collectives;
///    they may issue collectives of their own on `pg` (every rank then issues them).
/// It returns the FitResult on every rank (the same losses and validation metrics;
/// train_seconds is the rank's own), and throws (c10::Error) what the hooks, the
/// collectives, the checkpoint layer or its own checks throw.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/trainer/callback.h"
#include "fsdp/trainer/fit_result.h"
#include "fsdp/trainer/trainer_options.h"

namespace fsdp::trainer {

/// The model and the optimizer the loop trains; borrowed, they must outlive the call.
struct LoopModel {
  /// Exactly one of the two: the FSDP wrapper, or the ZeRO optimizer (== optimizer).
  FullyShardedBase* fsdp = nullptr;
  optim::ZeroRedundancyOptimizer* zero = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  torch::optim::LRScheduler* scheduler = nullptr;  ///< optional
  /// The user's module (not the FSDP wrapper): train()/eval() switch it and its subtree.
  torch::nn::Module* module = nullptr;
  int64_t num_params = 0;  ///< elements of the unwrapped model's parameters
};

/// The data and the user's steps as functions of sample indices; the sizes count samples.
struct LoopData {
  int64_t train_size = 0, val_size = 0;
  /// The user's training step on samples `indices` of the training set: the mean loss.
  std::function<at::Tensor(const std::vector<int64_t>& indices)> train_step;
  /// The user's validation step (empty: none), run under NoGradGuard: per-key means.
  std::function<std::map<std::string, double>(const std::vector<int64_t>& indices)> validation_step;

  /// Optional batch sampler (Trainer::batch_sampler): the sample indices of global step
  /// `step`'s (0-based, counted from the run's start) global batch, the same on every
  /// rank. Empty: GlobalSampler over train_size with the options' seed, shuffle and
  /// last_batch ([Note: global batches], steps 1-2). Either way the loop cuts the batch
  /// into micro-batches and contiguous rank parts (steps 3-4), so rank r of N trains on
  /// indices [r*m/N, (r+1)*m/N) of an m-sample batch (k = 1).
  std::function<std::vector<int64_t>(int64_t step)> batch_indices;
  /// With batch_indices: optimizer steps per epoch (max_epochs and the metrics' epoch).
  int64_t steps_per_epoch = 0;

  /// Optional validation of one's own (Trainer::validation_loop), instead of
  /// validation_step over val_size: runs on every rank when a validation is due (it may
  /// slice and reduce the validation set as it likes, collectively) and returns the
  /// global metrics, the same on every rank. Run with the module in eval() and under
  /// NoGradGuard; its time is not training time (FitResult::train_seconds).
  std::function<ValidationMetrics(int64_t step)> validation_loop;

  /// Optional resume check (Trainer::resume_check), run on every rank before the
  /// loop's own check of the data-order values: "" if a checkpoint's extra values
  /// (`saved`, what on_save_checkpoint added included) continue this run, else why not,
  /// naming the checkpoint `dir`, the setting and the fix. Under resume "auto" a refused
  /// checkpoint is passed over with that message; an explicit resume fails with it.
  std::function<std::string(const std::string& dir, const std::map<std::string, std::string>& saved)> resume_check;
};

/// How the loop's messages on stderr and its errors name the program and its resume
/// setting. The Trainer keeps the defaults; a program with a command line of its own
/// passes its name and its flag, so that its user reads the words they typed:
/// "fsdp-train: --resume auto: skipped: --resume DIR: unreadable metadata.json".
struct LoopNames {
  std::string program = "fsdp::Trainer";  ///< what every message starts with
  std::string resume = "resume";          ///< the setting TrainerOptions::resume comes from
};

/// Runs fit() on this rank (see the contract above). Collective over `pg`.
FitResult run_training_loop(const TrainerOptions& o, const comm::ProcessGroup& pg, const LoopModel& model,
                            const LoopData& data, const std::vector<std::shared_ptr<Callback>>& callbacks,
                            const LoopNames& names = {});

}  // namespace fsdp::trainer
