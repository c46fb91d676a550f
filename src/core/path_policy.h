#pragma once
// path_policy's callable, named so that ShardedInitContext can recognise it (and
// refuse it: paths do not exist while modules are being constructed).
#include <algorithm>
#include <string>
#include <vector>

#include <torch/nn/module.h>

namespace fsdp::core::detail {

struct PathPolicy {
  std::vector<std::string> paths;
  bool operator()(const std::string& path, const torch::nn::Module&, int64_t) const {
    return std::find(paths.begin(), paths.end(), path) != paths.end();
  }
};

}  // namespace fsdp::core::detail
