#pragma once
// Internal to src/state: which of a safetensors source's tensors fill which of a model's
// ([Note: loading safetensors] in include/fsdp/state/safetensors.h). Pure bookkeeping on
// names, shapes and dtypes: nothing is read here, so a load that does not match fails before
// any value changed.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/state/safetensors.h"
#include "load_targets.h"
#include "safetensors_source.h"

namespace fsdp::state {

struct NameMatch {
  struct Direct {
    size_t target = 0;
    std::string file_name;
  };
  struct RuleUse {
    size_t rule = 0;
    std::vector<size_t> targets;  // one per name in the rule's `to`
  };
  std::vector<Direct> direct;
  std::vector<RuleUse> rules;
  std::vector<std::string> missing, unexpected;
  std::string error;  // what makes the load impossible, "" when it can go on
};

/// Matches `source`'s names to `targets` by `options`' rules, name_map and rename. `error`
/// says what cannot be loaded (an unknown name in a rule, a shape or dtype that does not fit,
/// two file tensors for one model tensor that are not its tied names) and, when strict, what
/// is missing or unexpected.
NameMatch match_names(const SafetensorsSource& source, const std::vector<LoadTarget>& targets,
                      const SafetensorsLoadOptions& options);

}  // namespace fsdp::state
