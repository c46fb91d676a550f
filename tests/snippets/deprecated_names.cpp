// Every public name renamed with a deprecated alias (CHANGELOG.md, "Renamed") still compiles
// in its earlier spelling and means the new name. Built by the target `snippets`
// (tests/snippets/CMakeLists.txt), so test_snippets fails when an alias goes missing or
// stops meaning its replacement. Our own code uses only the new names; here the
// deprecation warnings are the point, so they are silenced for this file alone.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#include <type_traits>
#include <utility>

#include "fsdp/comm/call_label.h"
#include "fsdp/comm/launch_env.h"
#include "fsdp/comm/types.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/mixed_precision.h"  // the earlier path of fsdp/precision/mixed_precision.h
#include "fsdp/core/options.h"
#include "fsdp/core/state_dict_type.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/trainer/trainer_options.h"
#include "fsdp/trainer/training_facade.h"

namespace deprecated_names {

// TrainingFacade and FacadeOptions moved from fsdp::optim to fsdp::trainer.
static_assert(std::is_same_v<fsdp::optim::TrainingFacade, fsdp::trainer::TrainingFacade>);
static_assert(std::is_same_v<fsdp::optim::FacadeOptions, fsdp::trainer::FacadeOptions>);

// Public enums in kCamel; the ALL_CAPS enumerators keep their values.
static_assert(fsdp::ShardingStrategy::FULL_SHARD == fsdp::ShardingStrategy::kFullShard);
static_assert(fsdp::ShardingStrategy::SHARD_GRAD_OP == fsdp::ShardingStrategy::kShardGradOp);
static_assert(fsdp::ShardingStrategy::NO_SHARD == fsdp::ShardingStrategy::kNoShard);
static_assert(fsdp::ShardingStrategy::HYBRID_SHARD == fsdp::ShardingStrategy::kHybridShard);

static_assert(fsdp::BackwardPrefetch::NONE == fsdp::BackwardPrefetch::kNone);
static_assert(fsdp::BackwardPrefetch::BACKWARD_PRE == fsdp::BackwardPrefetch::kBackwardPre);
static_assert(fsdp::BackwardPrefetch::BACKWARD_POST == fsdp::BackwardPrefetch::kBackwardPost);

static_assert(fsdp::StateDictType::FULL == fsdp::StateDictType::kFull);
static_assert(fsdp::StateDictType::LOCAL == fsdp::StateDictType::kLocal);
static_assert(fsdp::StateDictType::SHARDED == fsdp::StateDictType::kSharded);

static_assert(fsdp::trainer::StrategyKind::FSDP == fsdp::trainer::StrategyKind::kFsdp);
static_assert(fsdp::trainer::StrategyKind::FULL_SHARD == fsdp::trainer::StrategyKind::kFullShard);
static_assert(fsdp::trainer::StrategyKind::SHARD_GRAD_OP == fsdp::trainer::StrategyKind::kShardGradOp);
static_assert(fsdp::trainer::StrategyKind::HYBRID_SHARD == fsdp::trainer::StrategyKind::kHybridShard);
static_assert(fsdp::trainer::StrategyKind::NO_SHARD == fsdp::trainer::StrategyKind::kNoShard);
static_assert(fsdp::trainer::StrategyKind::ZERO1 == fsdp::trainer::StrategyKind::kZero1);
static_assert(fsdp::trainer::StrategyKind::ZERO2 == fsdp::trainer::StrategyKind::kZero2);

// The CamelCase enumerators of comm and state in kCamel too.
static_assert(fsdp::comm::ReduceOp::Sum == fsdp::comm::ReduceOp::kSum);
static_assert(fsdp::comm::ReduceOp::Avg == fsdp::comm::ReduceOp::kAvg);
static_assert(fsdp::comm::ReduceOp::Max == fsdp::comm::ReduceOp::kMax);
static_assert(fsdp::comm::CommPath::Local == fsdp::comm::CommPath::kLocal);
static_assert(fsdp::comm::CommPath::SharedMemory == fsdp::comm::CommPath::kSharedMemory);
static_assert(fsdp::comm::CommPath::Gloo == fsdp::comm::CommPath::kGloo);
static_assert(fsdp::comm::CommPath::Nccl == fsdp::comm::CommPath::kNccl);
static_assert(fsdp::comm::Backend::Auto == fsdp::comm::Backend::kAuto);
static_assert(fsdp::comm::Backend::Gloo == fsdp::comm::Backend::kGloo);
static_assert(fsdp::comm::Backend::NCCL == fsdp::comm::Backend::kNccl);
static_assert(fsdp::comm::Phase::Unlabelled == fsdp::comm::Phase::kUnlabelled);
static_assert(fsdp::comm::Phase::Setup == fsdp::comm::Phase::kSetup);
static_assert(fsdp::comm::Phase::Forward == fsdp::comm::Phase::kForward);
static_assert(fsdp::comm::Phase::Backward == fsdp::comm::Phase::kBackward);
static_assert(fsdp::comm::Phase::Step == fsdp::comm::Phase::kStep);
static_assert(fsdp::comm::Phase::StateDict == fsdp::comm::Phase::kStateDict);
static_assert(fsdp::comm::Phase::Checkpoint == fsdp::comm::Phase::kCheckpoint);
static_assert(fsdp::comm::Phase::Trainer == fsdp::comm::Phase::kTrainer);
static_assert(fsdp::comm::LaunchSource::Explicit == fsdp::comm::LaunchSource::kExplicit);
static_assert(fsdp::comm::LaunchSource::Torchrun == fsdp::comm::LaunchSource::kTorchrun);
static_assert(fsdp::comm::LaunchSource::Slurm == fsdp::comm::LaunchSource::kSlurm);
static_assert(fsdp::comm::LaunchSource::OpenMPI == fsdp::comm::LaunchSource::kOpenMpi);
static_assert(fsdp::comm::LaunchSource::SingleProcess == fsdp::comm::LaunchSource::kSingleProcess);
static_assert(fsdp::OptimKey::ByName == fsdp::OptimKey::kByName);
static_assert(fsdp::OptimKey::ByPosition == fsdp::OptimKey::kByPosition);

// MixedPrecision's header moved to the precision layer; the earlier path still declares it.
static_assert(std::is_class_v<fsdp::MixedPrecision>);

// Options::offload_params is now cpu_offload: the old setter and getter forward to it.
static_assert(std::is_same_v<decltype(std::declval<fsdp::Options&>().offload_params(true)), fsdp::Options&>);
static_assert(std::is_same_v<decltype(std::declval<const fsdp::Options&>().offload_params()), bool>);
[[maybe_unused]] bool offload_params_forwards() {
  fsdp::Options o;
  o.offload_params(true);
  return o.cpu_offload() && o.offload_params();
}

// Guards by value (not a rename, no alias: a program that spelled std::unique_ptr<Guard>
// holds the guard itself or a std::optional of it); `auto guard = model->no_sync();` compiles.
using fsdp::FullyShardedBase;
using fsdp::optim::ZeroRedundancyOptimizer;
static_assert(std::is_same_v<decltype(std::declval<FullyShardedBase&>().no_sync()), FullyShardedBase::NoSyncGuard>);
static_assert(std::is_same_v<decltype(std::declval<FullyShardedBase&>().no_step()), FullyShardedBase::NoStepGuard>);
static_assert(std::is_same_v<decltype(std::declval<ZeroRedundancyOptimizer&>().no_step()),
                             ZeroRedundancyOptimizer::NoStepGuard>);
static_assert(std::is_move_constructible_v<FullyShardedBase::NoSyncGuard> &&
              !std::is_copy_constructible_v<FullyShardedBase::NoSyncGuard>);
static_assert(std::is_move_constructible_v<FullyShardedBase::NoStepGuard> &&
              !std::is_copy_constructible_v<FullyShardedBase::NoStepGuard>);
static_assert(std::is_move_constructible_v<ZeroRedundancyOptimizer::NoStepGuard> &&
              !std::is_copy_constructible_v<ZeroRedundancyOptimizer::NoStepGuard>);

}  // namespace deprecated_names
