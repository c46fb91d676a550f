#pragma once
// Planning units before anything is created: which wrap candidates the policy
// chooses (walk_wrap_policy), which parameters each unit owns
// (assign_parameters), and how a unit's flat buffer is laid out over the shard
// group (shard_layout, unit_precision). Shared by FullyShardedDataParallel's
// construction (build_units in fully_sharded.cpp) and by ShardedInitContext
// (sharded_init.cpp), which plans the same way over one Wrappable's subtree when
// its constructor returns, so both arrive at the same units.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include "flat_param.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/options.h"
#include "resolved_options.h"

namespace fsdp::core::detail {

using precision::unit_precision;

std::string join_path(const std::string& a, const std::string& b);
std::string module_path_of(const std::string& fqn);
/// Whether module `path` lies in the subtree at `prefix` ("" contains everything).
bool path_within(const std::string& path, const std::string& prefix);

/// Subtrees the user asked FSDP to leave alone, by module path.
class IgnoredModules {
 public:
  IgnoredModules() = default;
  IgnoredModules(torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
  bool contains(const std::string& path) const;

 private:
  std::vector<std::string> paths_;
};

/// A unit as planned before anything is created.
struct PlannedUnit {
  enum class Kind {
    kRoot,       // the wrapper's own call site
    kCallSite,   // a wrap candidate the policy chose ([Note: wrap candidates])
    kBatchNorm,  // mixed precision's full-precision BatchNorm unit: no call site
  };
  Kind kind = Kind::kCallSite;
  std::string path;
  // CallSite: the candidate's module, and for a Sequential entry its Sequential and index.
  std::shared_ptr<torch::nn::Module> module;
  const torch::nn::Module* identity = nullptr;  // the candidate's module (set also while it is being constructed)
  std::shared_ptr<torch::nn::SequentialImpl> sequential;
  size_t index = 0;
  bool list_entry = false;  // a ModuleList/ModuleDict entry: its call site is fsdp::call
  std::vector<FlatParamEntry> entries;  // assign_parameters
};

/// How the walk treats a candidate: ask the policy, or take it as a unit
/// already decided (ShardedInitContext: sharded when its own constructor returned;
/// its subtree is not visited again).
using DecidedUnit = std::function<bool(const torch::nn::Module&)>;

/// The wrap policy, called bottom-up over the wrap candidates of `model`.
/// Returns the root, then the chosen candidates in pre-order. With
/// `model_is_candidate` (ShardedInitContext: `model` is a Wrappable whose
/// constructor just returned), the policy is asked about `model` itself last,
/// with path "", and a chosen `model` is a CallSite unit with path "" right
/// after the root. `model` itself is never passed to `decided`.
std::vector<PlannedUnit> walk_wrap_policy(torch::nn::Module& model, const WrapPolicy& policy,
                                          const IgnoredModules& ignored, bool model_is_candidate = false,
                                          const DecidedUnit& decided = nullptr);

/// Mixed precision: each BatchNorm layer's parameters form a unit of their own
/// in full precision (MixedPrecision::full_precision_batch_norm).
void add_batch_norm_units(torch::nn::Module& model, const IgnoredModules& ignored, std::vector<PlannedUnit>& units);

/// Every parameter goes to the deepest unit whose path contains its module (a
/// BatchNorm unit takes its layer's own parameters); a tied parameter is
/// flattened once and must not span two units (error naming both paths).
void assign_parameters(torch::nn::Module& model, const IgnoredModules& ignored, std::vector<PlannedUnit>& units);

bool is_batch_norm(const torch::nn::Module& m);

/// Options::param_init_fn on every module of `root` that registers parameters
/// the unit owns (module paths of its entries), in named_modules order.
void run_param_init_fn(const ParamInitFn& fn, torch::nn::Module& root, const PlannedUnit& p);

/// One unit holds one dtype and device; throws naming both parameters otherwise.
void check_one_dtype_and_device(const PlannedUnit& p);

/// This rank's place in the flat buffers: the shard group's rank and size
/// ([Note: hybrid groups] in comm_context.h: consecutive blocks of shard_group_size
/// ranks), and whether units are sharded at all (not under NO_SHARD, nor
/// HYBRID_SHARD with groups of one rank).
struct ShardLayout {
  int rank = 0;
  int world = 1;
  bool sharded = false;
};
ShardLayout shard_layout(const ResolvedOptions& resolved, const comm::ProcessGroup& pg);

}  // namespace fsdp::core::detail
