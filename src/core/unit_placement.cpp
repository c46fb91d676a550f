#include "unit_placement.h"

#include <torch/optim/optimizer.h>

#include "engine/placement.h"
#include "unit.h"

namespace fsdp::core::detail {

namespace {

// What placement moves with the unit: its shard, and its trainable parameters' optimizer state.
engine::OffloadedPiece piece_of(const Unit& unit) {
  engine::OffloadedPiece p;
  const at::Tensor& shard = unit.flat().shard();
  p.tensor_bytes = shard.numel() * static_cast<int64_t>(shard.element_size());
  for (const auto& e : unit.flat().entries())
    if (e.param.requires_grad()) p.state_params.push_back(e.param);
  return p;
}

}  // namespace

std::vector<Unit*> place_units_on_device(const std::vector<Unit*>& reduce_order,
                                         const torch::optim::Optimizer& optimizer, double ratio) {
  std::vector<Unit*> candidates;
  std::vector<engine::OffloadedPiece> pieces;
  for (Unit* u : reduce_order) {
    if (!u->flat().offloaded() || !u->has_grad_params()) continue;
    candidates.push_back(u);
    pieces.push_back(piece_of(*u));
  }
  if (candidates.empty()) return {};
  const c10::Device device = candidates.front()->flat().options().device();
  std::vector<Unit*> placed;
  engine::place_on_device(pieces, optimizer, device, ratio, [&](size_t i) {
    candidates[i]->place_shard_on_device();
    placed.push_back(candidates[i]);
  });
  return placed;
}

}  // namespace fsdp::core::detail
