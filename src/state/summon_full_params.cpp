#include "fsdp/state/summon_full_params.h"

#include <torch/torch.h>

#include "../fsdp/runtime.h"
#include "fsdp/dist/collectives.h"

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
  // Own full buffers in the shards' dtype (not the units' unsharded buffers,
  // which hold the low-precision compute copy under mixed precision), so what
  // the user sees and writes back is the full-precision value.
  const bool show = !options.rank0_only() || model.process_group().rank() == 0;
  for (auto& u : rt.units()) {
    if (!options.recurse() && !u->is_root()) continue;
    auto& flat = u->flat();
    at::Tensor full = flat.shard();
    if (flat.sharded()) {
      full = torch::empty({flat.padded_numel()}, flat.options());
      dist::all_gather_into(rt.gather_group(), full, flat.shard()).wait();  // the shard group
    }
    if (!show) continue;  // took part in the gather only
    flat.use_views_of(full);
    units_.push_back(u->index());
    buffers_.push_back(full);
  }
}

SummonFullParams::~SummonFullParams() noexcept(false) {
  auto& units = model_->runtime().units();
  for (size_t k = 0; k < units_.size(); ++k) {
    auto& flat = units[units_[k]]->flat();
    if (options_.writeback()) flat.copy_chunk_to_shard(buffers_[k]);
    flat.use_shard_views();
  }
  buffers_.clear();
}

}  // namespace fsdp
