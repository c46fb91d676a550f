#include "backward_optimizer.h"

#include <unordered_map>
#include <utility>

#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include "unit.h"

namespace fsdp::detail {

namespace {

// The units' trainable parameters by TensorImpl, with their unit and name.
struct ManagedParam {
  const Unit* unit;
  const std::string* fqn;
};
std::unordered_map<const c10::TensorImpl*, ManagedParam> managed_params(const std::vector<Unit*>& units) {
  std::unordered_map<const c10::TensorImpl*, ManagedParam> out;
  for (const Unit* u : units)
    for (const auto& e : u->flat().entries())
      if (e.param.requires_grad()) out.emplace(e.param.unsafeGetTensorImpl(), ManagedParam{u, &e.fqn});
  return out;
}

// Moves every defined gradient of `params` aside for its lifetime, then puts them back.
class SetAsideGrads {
 public:
  explicit SetAsideGrads(std::vector<at::Tensor>& params) : params_(params), grads_(params.size()) {
    for (size_t i = 0; i < params_.size(); ++i) grads_[i] = std::exchange(params_[i].mutable_grad(), at::Tensor());
  }
  ~SetAsideGrads() {
    for (size_t i = 0; i < params_.size(); ++i)
      if (grads_[i].defined()) params_[i].mutable_grad() = std::move(grads_[i]);
  }
  SetAsideGrads(const SetAsideGrads&) = delete;
  SetAsideGrads& operator=(const SetAsideGrads&) = delete;

 private:
  std::vector<at::Tensor>& params_;
  std::vector<at::Tensor> grads_;
};

}  // namespace

BackwardOptimizer::BackwardOptimizer(torch::optim::Optimizer& optimizer, const std::vector<Unit*>& units, int rank)
    : optimizer_(optimizer) {
  TORCH_CHECK(dynamic_cast<torch::optim::LBFGS*>(&optimizer) == nullptr, "fsdp (rank ", rank,
              "): Options::optimizer_in_backward cannot step torch::optim::LBFGS: it re-evaluates the loss "
              "through a closure and needs every gradient at once. Use it with optimizer_in_backward(false)");
  const auto managed = managed_params(units);
  std::unordered_set<const c10::TensorImpl*> seen;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t j = 0; j < groups[g].params().size(); ++j) {
      const at::Tensor& p = groups[g].params()[j];
      const auto it = managed.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != managed.end(), "fsdp (rank ", rank, "): register_optimizer_in_backward: parameter ", j,
                  " of the optimizer's group ", g, " (", p.sizes(), ") is not a trainable parameter of this "
                  "FullyShardedDataParallel's units (an ignored module's, a frozen one or another model's), so no "
                  "reduction in backward would step it. Build the optimizer over model->parameters() of trainable, "
                  "wrapped modules only");
      // A tied parameter listed under each of its names (model->parameters() does so) is
      // stepped once per listing, inside backward as after it.
      if (seen.insert(p.unsafeGetTensorImpl()).second) params_.push_back(p);
    }
  }
}

void BackwardOptimizer::step(Unit& unit) {
  SetAsideGrads others(params_);
  unit.step_reduced_shard([this] { optimizer_.step(); });
}

}  // namespace fsdp::detail
