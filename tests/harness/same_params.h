#pragma once
// Bitwise equality of two models' parameters, name by name, for tests that train a model
// against a reference run of the same model.
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace fsdp::testing {

inline void expect_same_params(torch::nn::Module& a, torch::nn::Module& b, const std::string& where) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i].key(), pb[i].key());
    EXPECT_TRUE(torch::equal(pa[i].value(), pb[i].value())) << where << ": parameter " << pa[i].key() << " differs";
  }
}

}  // namespace fsdp::testing
