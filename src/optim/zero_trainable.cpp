#include "zero_trainable.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp::optim::detail {

namespace {

using ModuleNames = std::unordered_map<const c10::TensorImpl*, std::pair<std::string, int64_t>>;

/// Each parameter of `module` with its path and registration index.
ModuleNames module_names(const torch::nn::Module* module) {
  ModuleNames known;
  if (!module) return known;
  int64_t k = 0;
  for (const auto& p : module->named_parameters(/*recurse=*/true))
    known.emplace(p.value().unsafeGetTensorImpl(), std::make_pair(p.key(), k++));
  return known;
}

struct Candidate {
  ZeroTrainable entry;
  int64_t order = 0;  // registration index; parameters outside the module after all of it
};

/// Every trainable parameter must have the first one's dtype and device (a floating
/// dtype; fp32 under mixed precision).
void check_one_dtype(const std::vector<ZeroTrainable>& trainable, bool mixed_precision, int rank) {
  if (trainable.empty()) return;
  const ZeroTrainable& first = trainable.front();
  TORCH_CHECK(c10::isFloatingType(first.param.scalar_type()), "ZeroRedundancyOptimizer (rank ", rank,
              "): trainable parameter ", first.name, " is ", first.param.scalar_type(),
              "; only floating-point parameters can be trained");
  TORCH_CHECK(!mixed_precision || first.param.scalar_type() == at::kFloat, "ZeroRedundancyOptimizer (rank ", rank,
              "): param_dtype (mixed precision) makes fp32 master weights from the parameters, but ", first.name,
              " is ", first.param.scalar_type(), "; build the model in fp32");
  for (const ZeroTrainable& e : trainable)
    TORCH_CHECK(e.param.scalar_type() == first.param.scalar_type() && e.param.device() == first.param.device(),
                "ZeroRedundancyOptimizer (rank ", rank, "): trainable parameter ", e.name, " is ",
                e.param.scalar_type(), " on ", e.param.device(), " but ", first.name, " is ",
                first.param.scalar_type(), " on ", first.param.device(),
                "; all trainable parameters share one flat buffer: give them one dtype and device "
                "(model->to(...)) before building the optimizer");
}

}  // namespace

ZeroParameters collect_parameters(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                  const torch::nn::Module* module, bool mixed_precision, int rank) {
  const ModuleNames known = module_names(module);
  ZeroParameters out;
  std::vector<Candidate> candidates;
  std::unordered_map<const c10::TensorImpl*, std::string> seen;
  int64_t appearance = static_cast<int64_t>(known.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t j = 0; j < groups[g].params().size(); ++j) {
      const at::Tensor& p = groups[g].params()[j];
      const std::string where = "param_groups[" + std::to_string(g) + "][" + std::to_string(j) + "]";
      TORCH_CHECK(p.defined(), "ZeroRedundancyOptimizer (rank ", rank, "): ", where, " is an undefined tensor");
      auto it = known.find(p.unsafeGetTensorImpl());
      const std::string name = it != known.end() ? "'" + it->second.first + "' (" + where + ")" : where;
      auto dup = seen.emplace(p.unsafeGetTensorImpl(), where);
      TORCH_CHECK(dup.second, "ZeroRedundancyOptimizer (rank ", rank, "): parameter ", name, " is also ",
                  dup.first->second, "; put each parameter in exactly one group");
      TORCH_CHECK(p.is_leaf(), "ZeroRedundancyOptimizer (rank ", rank, "): parameter ", name,
                  " is not a leaf tensor; pass the model's parameters (model->parameters())");
      if (!p.requires_grad()) {
        out.frozen.push_back(p);
        continue;
      }
      TORCH_CHECK(!p.is_sparse() && p.layout() == at::kStrided, "ZeroRedundancyOptimizer (rank ", rank,
                  "): parameter ", name, " is not a dense tensor");
      const int64_t order = it != known.end() ? it->second.second : appearance++;
      candidates.push_back({{p, name, it != known.end() ? it->second.first : std::string(), static_cast<int>(g)},
                            order});
    }
  }
  // Flat order: reverse registration order, the order backward usually produces gradients.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.order > b.order; });
  for (Candidate& c : candidates) out.trainable.push_back(std::move(c.entry));
  check_one_dtype(out.trainable, mixed_precision, rank);
  return out;
}

}  // namespace fsdp::optim::detail
