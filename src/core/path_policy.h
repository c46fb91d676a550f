#pragma once
// path_policy's callable, named so that the unit plan can check what it names (a path that
// names no module, or a module that is no wrap candidate, is refused: walk_wrap_policy) and
// ShardedInitContext can refuse it (paths do not exist while modules are being constructed).
//
// A listed path is a module path as named_modules gives it ("blocks.3.attn"), or a pattern in
// which `*` stands for any characters within one component ("blocks.*", "h.*.mlp").
#include <string>
#include <vector>

#include <torch/nn/module.h>

namespace fsdp::core::detail {

/// Whether `path` matches `pattern` (`*`: any run of characters other than '.').
bool path_matches(const std::string& pattern, const std::string& path);

struct PathPolicy {
  std::vector<std::string> paths;
  bool matches(const std::string& path) const {
    for (const auto& p : paths)
      if (path_matches(p, path)) return true;
    return false;
  }
  bool operator()(const std::string& path, const torch::nn::Module&, int64_t) const { return matches(path); }
};

}  // namespace fsdp::core::detail
