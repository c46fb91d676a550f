#include "fsdp/optim/group_options.h"

namespace fsdp {
namespace optim {

void keep_group_options(torch::optim::Optimizer& opt,
                        const std::vector<torch::optim::OptimizerParamGroup>& given) {
  auto& groups = opt.param_groups();
  TORCH_CHECK(given.size() <= groups.size(), "fsdp::optim::keep_group_options: ", given.size(),
              " groups given, but the optimizer has only ", groups.size(),
              "; pass the groups the optimizer was constructed from");
  for (size_t g = 0; g < given.size(); ++g) {
    if (given[g].has_options()) groups[g].set_options(given[g].options().clone());
  }
}

void add_param_group_keeping_options(torch::optim::Optimizer& opt,
                                     const torch::optim::OptimizerParamGroup& group) {
  opt.add_param_group(group);
  if (group.has_options()) opt.param_groups().back().set_options(group.options().clone());
}

}  // namespace optim
}  // namespace fsdp
