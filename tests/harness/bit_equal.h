#pragma once
// Bitwise equality of two lists of tensors (parameters, optimizer state), in order: for "a skipped
// step changed nothing" and "a round trip gives the same bits".
#include <torch/torch.h>

#include <vector>

namespace fsdp::testing {

inline bool bit_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i].equal(b[i])) return false;
  return true;
}

}  // namespace fsdp::testing
