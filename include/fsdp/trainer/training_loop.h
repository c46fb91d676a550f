#pragma once
/// The type-erased half of fsdp::trainer::Trainer: the loop itself (sampling,
/// accumulation, clipping, stepping, validation, checkpoints, resume, metrics,
/// progress, memory summary), compiled once into the library. trainer.h builds the
/// model and the optimizer with the user's types and hands them over as a
/// LoopModel; the datasets and the user's steps arrive as functions of sample
/// indices (LoopData). Users call Trainer, not this.

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

#include "fsdp/dist/process_group.h"
#include "fsdp/fsdp/fully_sharded.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/trainer/callback.h"
#include "fsdp/trainer/fit_result.h"
#include "fsdp/trainer/trainer_options.h"

namespace fsdp::trainer::detail {

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

struct LoopData {
  int64_t train_size = 0, val_size = 0;
  /// The user's training step on samples `indices` of the training set: the mean loss.
  std::function<at::Tensor(const std::vector<int64_t>& indices)> train_step;
  /// The user's validation step (empty: none), run under NoGradGuard: per-key means.
  std::function<std::map<std::string, double>(const std::vector<int64_t>& indices)> validation_step;
};

/// Runs fit() on this rank. Collective over `pg`. Options must have passed
/// trainer_options_error.
FitResult run_training_loop(const TrainerOptions& o, const dist::ProcessGroup& pg, const LoopModel& model,
                            const LoopData& data, const std::vector<std::shared_ptr<Callback>>& callbacks);

}  // namespace fsdp::trainer::detail
