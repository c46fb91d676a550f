#include "unit_placement.h"

#include <cstdint>

#include <torch/optim/optimizer.h>

#include "fsdp/memory/optimizer_state_bytes.h"
#include "memory/param_state_key.h"
#include "memory/placement.h"
#include "unit.h"

namespace fsdp::detail {

namespace {

// The unit's trainable parameters' optimizer state, or null where there is none yet.
std::vector<const torch::optim::OptimizerParamState*> states_of(const Unit& unit,
                                                               const torch::optim::Optimizer& optimizer) {
  std::vector<const torch::optim::OptimizerParamState*> out;
  for (const auto& e : unit.flat().entries()) {
    if (!e.param.requires_grad()) continue;
    if (const auto* s = memory::param_state(optimizer, e.param)) out.push_back(s);
  }
  return out;
}

int64_t placed_bytes(const Unit& unit, const torch::optim::Optimizer& optimizer) {
  const at::Tensor& shard = unit.flat().shard();
  int64_t bytes = shard.numel() * static_cast<int64_t>(shard.element_size());
  for (const auto* s : states_of(unit, optimizer)) bytes += memory::optimizer_state_bytes(*s);
  return bytes;
}

}  // namespace

std::vector<Unit*> place_units_on_device(const std::vector<Unit*>& reduce_order,
                                         const torch::optim::Optimizer& optimizer, double ratio) {
  std::vector<Unit*> candidates;
  for (Unit* u : reduce_order)
    if (u->flat().offloaded() && u->has_grad_params()) candidates.push_back(u);
  if (candidates.empty()) return {};
  // 1. The budget: the compute device's margin at the warm-up iteration's peak.
  const c10::Device device = candidates.front()->flat().options().device();
  const int64_t budget = memory::margin_budget(memory::device_memory(device), ratio);
  // 2. The units that fit, in reduce order.
  std::vector<int64_t> bytes;
  for (const Unit* u : candidates) bytes.push_back(placed_bytes(*u, optimizer));
  const std::vector<uint8_t> chosen = memory::device_pieces(bytes, budget);
  // 3. Their shards, and the state with them.
  std::vector<Unit*> placed;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!chosen[i]) continue;
    for (const auto* s : states_of(*candidates[i], optimizer)) memory::move_optimizer_state(*s, device);
    candidates[i]->place_shard_on_device();
    placed.push_back(candidates[i]);
  }
  return placed;
}

}  // namespace fsdp::detail
