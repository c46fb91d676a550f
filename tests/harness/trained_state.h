#pragma once
// What a training run leaves for a bitwise comparison with its reference run.
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace fsdp::testing {

struct TrainedState {
  std::vector<std::vector<torch::Tensor>> grads;  ///< every parameter's gradient after each backward
  std::vector<torch::Tensor> params;              ///< the parameters at the end
};

/// Every gradient of every step and every final parameter of `a` equal to `ref`'s, bit for bit.
inline void expect_bitwise_equal(const TrainedState& a, const TrainedState& ref) {
  ASSERT_EQ(a.grads.size(), ref.grads.size());
  for (size_t s = 0; s < a.grads.size(); ++s) {
    ASSERT_EQ(a.grads[s].size(), ref.grads[s].size());
    for (size_t i = 0; i < a.grads[s].size(); ++i) {
      ASSERT_EQ(a.grads[s][i].defined(), ref.grads[s][i].defined()) << "step " << s << " parameter " << i;
      if (ref.grads[s][i].defined()) {
        EXPECT_TRUE(torch::equal(a.grads[s][i], ref.grads[s][i])) << "gradient, step " << s << " parameter " << i;
      }
    }
  }
  ASSERT_EQ(a.params.size(), ref.params.size());
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(torch::equal(a.params[i], ref.params[i])) << "parameter " << i << " after the steps";
}

}  // namespace fsdp::testing
