#pragma once
// ShardedInitContext's side of the hand-over to FullyShardedDataParallel ([Note:
// sharded construction] in include/fsdp/core/sharded_init.h). A unit sharded at
// construction is kept on the Wrappable whose constructor produced it
// (WrappableBase::fsdp_construction_units) until FSDP adopts it; nothing is
// global except the names of placeholders, for error messages.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "flat_param.h"
#include "fsdp/core/options.h"
#include "unit_plan.h"

namespace fsdp::core::detail {

/// What a unit's flat buffer was laid out for. FSDP adopts a unit only if its
/// own group and options give the same.
struct ShardingSignature {
  const void* group = nullptr;  // the c10d group's identity
  std::string group_name;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  ShardLayout layout;
  FlatPrecision precision;
};
std::string describe(const ShardingSignature& s);
bool same_sharding(const ShardingSignature& a, const ShardingSignature& b);
ShardingSignature sharding_signature(const comm::ProcessGroup& pg, const ResolvedOptions& resolved,
                                     at::ScalarType param_dtype);

/// A unit ShardedInitContext sharded when a Wrappable's constructor returned.
struct ConstructionUnit {
  const torch::nn::Module* module = nullptr;  // identity only (may be the holder itself)
  std::string relative_path;                  // of `module` under the Wrappable holding the record
  std::unique_ptr<FlatParameter> flat;        // null once adopted
  ShardingSignature signature;
  ~ConstructionUnit();
};

struct ConstructionUnits {
  std::vector<std::unique_ptr<ConstructionUnit>> units;
};

/// Units sharded at construction and not yet adopted, anywhere in `model`, by module.
std::map<const torch::nn::Module*, ConstructionUnit*> find_construction_units(torch::nn::Module& model);

/// FSDP takes the unit's flat parameter; its parameters point at their pieces again.
std::unique_ptr<FlatParameter> adopt_construction_unit(ConstructionUnit& unit);

}  // namespace fsdp::core::detail
