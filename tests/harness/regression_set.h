#pragma once
// A map-style dataset for Trainer tests: (x [13], y [5]) regression pairs drawn once from a fixed
// generator, so every rank and every run sees the same samples. CPU tensors: the Trainer moves
// each batch to its device.
#include <torch/torch.h>

#include <cstddef>
#include <cstdint>

namespace fsdp::testing {

class RegressionSet : public torch::data::datasets::Dataset<RegressionSet> {
 public:
  explicit RegressionSet(int64_t n, uint64_t seed = 77) {
    auto gen = at::detail::createCPUGenerator(seed);
    x_ = at::randn({n, 13}, gen);
    y_ = at::randn({n, 5}, gen);
  }
  torch::data::Example<> get(size_t i) override { return {x_[int64_t(i)], y_[int64_t(i)]}; }
  torch::optional<size_t> size() const override { return size_t(x_.size(0)); }
  const torch::Tensor& x() const { return x_; }
  const torch::Tensor& y() const { return y_; }

 private:
  torch::Tensor x_, y_;
};

}  // namespace fsdp::testing
