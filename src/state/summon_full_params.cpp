#include "fsdp/state/summon_full_params.h"

#include "../fsdp/runtime.h"

namespace fsdp {

SummonFullParams::SummonFullParams(FullyShardedBase& model, SummonFullParamsOptions options)
    : model_(&model), options_(options) {
  TORCH_CHECK(!(options.rank0_only() && options.writeback()), "fsdp: summon_full_params with rank0_only=true "
              "cannot write back (the other ranks never see the full values); pass writeback(false)");
  auto& rt = model.runtime();
  TORCH_CHECK(!rt.in_backward(), "fsdp: summon_full_params cannot run during backward");
  for (auto& u : rt.units()) {
    TORCH_CHECK(u->state() == detail::UnitState::IDLE && u->flat().state() == detail::FlatState::Sharded,
                "fsdp: summon_full_params on rank ", model.process_group().rank(), " while unit '", u->path(),
                "' is in state ", detail::to_string(u->state()),
                " (nested summon_full_params, or inside forward/backward); use it between steps");
  }
  const bool show = !options.rank0_only() || model.process_group().rank() == 0;
  for (auto& u : rt.units()) {
    if (!options.recurse() && !u->is_root()) continue;
    u->gather();
    if (show) {
      u->flat().use_unsharded_views();
    } else if (u->flat().sharded()) {
      u->flat().free_unsharded();  // took part in the gather only
      continue;
    }
    units_.push_back(u->index());
  }
}

SummonFullParams::~SummonFullParams() noexcept(false) {
  auto& units = model_->runtime().units();
  for (int i : units_) {
    auto& flat = units[i]->flat();
    if (options_.writeback()) flat.copy_unsharded_to_shard();
    if (flat.sharded()) flat.free_unsharded();
    flat.use_shard_views();
  }
}

}  // namespace fsdp
