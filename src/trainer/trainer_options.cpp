#include "fsdp/trainer/trainer_options.h"

#include <sstream>
#include <utility>
#include <vector>

#include <torch/cuda.h>

#include "fsdp/trainer/checkpoint_dir.h"

namespace fsdp::trainer {

namespace {

/// "" for a device word TrainerOptions::device knows, else what is wrong.
std::string device_word_error(const std::string& device) {
  if (device == "cpu" || device == "cuda") return "";
  return "unknown device '" + device + "'; use \"cpu\" or \"cuda\" (the rank's GPU; an index is not given: " +
         "the process group binds each rank's, see comm::InitOptions::device_index)";
}

constexpr StrategyKind kAllKinds[] = {StrategyKind::kFsdp,         StrategyKind::kFullShard, StrategyKind::kShardGradOp,
                                      StrategyKind::kHybridShard, StrategyKind::kNoShard,   StrategyKind::kZero1,
                                      StrategyKind::kZero2};

}  // namespace

const char* to_string(StrategyKind kind) {
  switch (kind) {
    case StrategyKind::kFsdp: return "fsdp";
    case StrategyKind::kFullShard: return "full_shard";
    case StrategyKind::kShardGradOp: return "shard_grad_op";
    case StrategyKind::kHybridShard: return "hybrid_shard";
    case StrategyKind::kNoShard: return "no_shard";
    case StrategyKind::kZero1: return "zero1";
    case StrategyKind::kZero2: return "zero2";
  }
  TORCH_INTERNAL_ASSERT(false, "StrategyKind ", static_cast<int>(kind));
}

Strategy Strategy::parse(const std::string& name) {
  std::string valid;
  for (StrategyKind kind : kAllKinds) {
    if (name == to_string(kind)) return Strategy(kind);
    valid += std::string(valid.empty() ? "" : ", ") + to_string(kind);
  }
  TORCH_CHECK(false, "unknown strategy '", name, "'; use one of ", valid);
}

int Strategy::zero_stage() const {
  TORCH_INTERNAL_ASSERT(is_zero(), "zero_stage() for strategy '", name(), "'");
  return kind_ == StrategyKind::kZero1 ? 1 : 2;
}

fsdp::Options Strategy::resolved_fsdp() const {
  fsdp::Options o = fsdp();
  switch (kind_) {
    case StrategyKind::kFsdp: break;
    case StrategyKind::kFullShard: o.sharding_strategy(ShardingStrategy::kFullShard); break;
    case StrategyKind::kShardGradOp: o.sharding_strategy(ShardingStrategy::kShardGradOp); break;
    case StrategyKind::kHybridShard: o.sharding_strategy(ShardingStrategy::kHybridShard); break;
    case StrategyKind::kNoShard: o.sharding_strategy(ShardingStrategy::kNoShard); break;
    case StrategyKind::kZero1:
    case StrategyKind::kZero2: TORCH_INTERNAL_ASSERT(false, "resolved_fsdp() for strategy '", name(), "'");
  }
  return o;
}

std::string trainer_options_error(const TrainerOptions& o, const TrainerParts& parts, int world_size) {
  std::ostringstream e;
  const std::string s = o.strategy().name();
  if (o.strategy().is_zero() && o.strategy().fsdp().mixed_precision().enabled())
    // ZeRO leaves the model unwrapped, so nothing would apply FSDP's policy: training
    // would silently run in fp32.
    e << "strategy '" << s << "' does not use fsdp().mixed_precision() (the model is not wrapped); "
      << "set Strategy::zero().param_dtype(torch::kBFloat16) for bf16 under ZeRO";
  else if (o.strategy().is_zero() && o.strategy().fsdp().optimizer_in_backward())
    // Silently stepping after backward would hide that the option is not taken.
    e << "strategy '" << s << "' does not use fsdp().optimizer_in_backward() (the model is not wrapped); "
      << "set Strategy::zero().optimizer_in_backward(true) under zero2";
  else if (!parts.model)
    e << "no model: call Trainer::model(factory) with a function that builds the model";
  else if (!parts.optimizer)
    e << "no optimizer: call Trainer::optimizer(factory) with a function of the (sharded) parameters";
  else if (!parts.train_data)
    e << "no training dataset: call Trainer::train_data(dataset)";
  else if (!parts.training_step)
    e << "no training step: call Trainer::training_step(fn) with a function (model, batch) -> loss";
  else if (parts.validation_loop && (parts.validation_step || parts.val_data))
    e << "both a validation loop and val_data/validation_step: give one of the two";
  else if (parts.batch_sampler && parts.sampler_steps_per_epoch <= 0)
    e << "the batch sampler's steps per epoch must be positive, got " << parts.sampler_steps_per_epoch;
  else if (!parts.validation_loop && parts.validation_step != parts.val_data)
    e << (parts.val_data ? "validation data but no validation step: call Trainer::validation_step(fn)"
                         : "a validation step but no validation data: call Trainer::val_data(dataset)");
  else if (o.global_batch_size() <= 0)
    e << "global_batch_size must be positive, got " << o.global_batch_size();
  else if (o.accumulate_grad_batches() <= 0)
    e << "accumulate_grad_batches must be >= 1, got " << o.accumulate_grad_batches();
  else if (o.global_batch_size() % o.accumulate_grad_batches() != 0)
    e << "global_batch_size " << o.global_batch_size() << " is not divisible by accumulate_grad_batches "
      << o.accumulate_grad_batches() << "; use a multiple of it";
  else if (world_size > 0 && o.global_batch_size() % (int64_t(world_size) * o.accumulate_grad_batches()) != 0)
    e << "global_batch_size " << o.global_batch_size() << " is not divisible by world size " << world_size
      << " x accumulate_grad_batches " << o.accumulate_grad_batches() << "; use a multiple of "
      << int64_t(world_size) * o.accumulate_grad_batches();
  else if (o.max_steps() < 0 || o.max_epochs() < 0 || (o.max_steps() == 0 && o.max_epochs() == 0 && o.export_safetensors().empty()))
    e << "nothing to train: max_steps " << o.max_steps() << ", max_epochs " << o.max_epochs() << "; set max_steps > 0 "
      << "or max_epochs > 0 (both 0 with export_safetensors: convert init_from without training)";
  else if (parts.train_size <= 0)
    e << "the training dataset is empty (size " << parts.train_size << ")";
  else if (!parts.batch_sampler && o.last_batch() == LastBatch::kDrop && parts.train_size < o.global_batch_size())
    e << "the training dataset has " << parts.train_size << " samples, fewer than one global batch of "
      << o.global_batch_size() << ", and last_batch is kDrop: nothing would train; use LastBatch::kShort "
      << "or a smaller global_batch_size";
  else if (parts.val_data && parts.val_size <= 0)
    e << "the validation dataset is empty (size " << parts.val_size << ")";
  else if (o.val_batch_size() < 0)
    e << "val_batch_size must be >= 0 (0: global_batch_size), got " << o.val_batch_size();
  else if (o.val_check_interval() < 0 || o.checkpoint_interval() < 0 || o.keep_checkpoints() < 0 ||
           o.log_every_n_steps() <= 0)
    e << "val_check_interval, checkpoint_interval and keep_checkpoints must be >= 0 and log_every_n_steps > 0";
  else if (!(o.gradient_clip_val() >= 0))
    e << "gradient_clip_val must be >= 0 (0: off), got " << o.gradient_clip_val();
  else if (o.gradient_clip_val() > 0 && (o.strategy().is_zero() ? o.strategy().zero().optimizer_in_backward()
                                                                  : o.strategy().fsdp().optimizer_in_backward()))
    e << "gradient_clip_val " << o.gradient_clip_val() << " needs every gradient before the step, but "
      << (o.strategy().is_zero() ? "ZeroOptions" : "fsdp::Options")
      << "::optimizer_in_backward steps inside backward; set gradient_clip_val(0) or turn optimizer_in_backward off";
  else if (o.checkpoint_interval() > 0 && o.checkpoint_dir().empty())
    e << "checkpoint_interval " << o.checkpoint_interval() << " needs a checkpoint_dir";
  else if (o.checkpoint_at_start() && o.checkpoint_dir().empty())
    e << "checkpoint_at_start needs a checkpoint_dir";
  else if (o.resume() == "auto" && o.checkpoint_dir().empty())
    e << "resume(\"auto\") looks under checkpoint_dir, which is empty; set checkpoint_dir";
  else if (o.devices() < 0 || o.num_nodes() < 1)
    e << "devices must be >= 0 (0: auto) and num_nodes >= 1, got devices " << o.devices() << ", num_nodes "
      << o.num_nodes();
  else if (o.threads() < 0)
    e << "threads must be >= 0, got " << o.threads();
  else if (const std::string d = device_word_error(o.device()); !d.empty())
    e << d;
  else if (o.device() == "cuda" && !parts.batch_to_device)
    e << "device \"cuda\" moves each batch to the GPU, but the batch type is not torch::data::Example<>; "
      << "give Trainer::batch_to_device(fn) to move it (or move the batch inside the steps and say so with "
      << "batch_to_device([](Batch&, const torch::Device&) {}))";
  return e.str();
}

std::string resume_path_error(const TrainerOptions& o) {
  const std::string& dir = o.resume();
  if (dir.empty() || dir == "auto") return "";
  std::vector<std::pair<std::string, std::string>> values;
  std::string why;
  if (read_checkpoint_values(dir, values, why)) return "";
  return "resume '" + dir + "': " + why + "; name a checkpoint directory that exists (" +
         (o.checkpoint_dir().empty() ? std::string("DIR") : o.checkpoint_dir()) +
         "/step-S), \"auto\" to continue from the newest one under checkpoint_dir, or nothing to start afresh";
}

std::string device_error(const TrainerOptions& o) {
  if (std::string d = device_word_error(o.device()); !d.empty()) return d;
  if (o.device() == "cuda" && !torch::cuda::is_available())
    return "device \"cuda\" but torch sees no CUDA device on this machine (torch::cuda::is_available() is "
           "false: no GPU or NVIDIA driver, CUDA_VISIBLE_DEVICES hides them, or libtorch was built without "
           "CUDA); use device(\"cpu\"), or run where a GPU is visible";
  return "";
}

c10::Device training_device(const TrainerOptions& o, const comm::ProcessGroup& pg) {
  if (o.device() == "cpu") return c10::Device(c10::kCPU);
  TORCH_INTERNAL_ASSERT(o.device() == "cuda", "training_device of an unchecked device '", o.device(), "'");
  TORCH_CHECK(pg.cuda_device() >= 0, "fsdp::Trainer (rank ", pg.rank(), "): device \"cuda\" but process group '",
              pg.name(), "' moves no CUDA tensors (some rank has no GPU, or the group was made before torch saw "
              "one); give every rank a GPU, or use device(\"cpu\")");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(pg.cuda_device()));
}

}  // namespace fsdp::trainer
