#include "placement.h"

#include <algorithm>

#include <torch/optim/optimizer.h>

#include "fsdp/memory/optimizer_state_bytes.h"
#include "memory/param_state_key.h"

namespace fsdp::engine {

int64_t margin_budget(const memory::DeviceMemory& m, double ratio) {
  const int64_t margin = std::max<int64_t>(0, m.capacity - m.peak_allocated);
  return static_cast<int64_t>(static_cast<double>(margin) * ratio);
}

std::vector<uint8_t> device_pieces(const std::vector<int64_t>& piece_bytes, int64_t budget) {
  std::vector<uint8_t> on_device(piece_bytes.size(), 0);
  for (size_t b = 0; b < piece_bytes.size(); ++b) {
    if (piece_bytes[b] > budget) continue;
    on_device[b] = 1;
    budget -= piece_bytes[b];
  }
  return on_device;
}

std::vector<uint8_t> place_on_device(const std::vector<OffloadedPiece>& pieces,
                                     const torch::optim::Optimizer& optimizer, const c10::Device& device,
                                     double ratio, const std::function<void(size_t)>& move) {
  if (pieces.empty()) return {};
  // 1. The budget: the device's margin at the warm-up step's peak.
  const int64_t budget = margin_budget(memory::device_memory(device), ratio);
  // 2. The pieces that fit, in order, by the bytes of their tensor and state.
  std::vector<int64_t> bytes;
  for (const OffloadedPiece& p : pieces) {
    int64_t b = p.tensor_bytes;
    for (const at::Tensor& param : p.state_params)
      if (const auto* s = memory::param_state(optimizer, param)) b += memory::optimizer_state_bytes(*s);
    bytes.push_back(b);
  }
  const std::vector<uint8_t> chosen = device_pieces(bytes, budget);
  // 3. Their state, and the pieces themselves.
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!chosen[i]) continue;
    for (const at::Tensor& param : pieces[i].state_params)
      if (const auto* s = memory::param_state(optimizer, param)) memory::move_optimizer_state(*s, device);
    move(i);
  }
  return chosen;
}

}  // namespace fsdp::engine
