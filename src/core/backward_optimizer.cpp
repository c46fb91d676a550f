#include "backward_optimizer.h"

#include <unordered_set>
#include <utility>

#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include "unit.h"

namespace fsdp::detail {

namespace {

// The units' trainable parameters.
std::unordered_set<const c10::TensorImpl*> managed_params(const std::vector<Unit*>& units) {
  std::unordered_set<const c10::TensorImpl*> out;
  for (const Unit* u : units)
    for (const auto& e : u->flat().entries())
      if (e.param.requires_grad()) out.insert(e.param.unsafeGetTensorImpl());
  return out;
}

// Moves every defined gradient of the optimizer's parameters aside for its lifetime,
// then puts them back. The groups are read at each step, so that a group added after
// registration is set aside too. A tied parameter listed twice is set aside once (its
// second listing then finds no gradient) and put back once.
class SetAsideGrads {
 public:
  explicit SetAsideGrads(const torch::optim::Optimizer& optimizer) {
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        params_.push_back(p);
        grads_.push_back(std::exchange(params_.back().mutable_grad(), at::Tensor()));
      }
    }
  }
  ~SetAsideGrads() {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = std::move(grads_[i]);
  }
  SetAsideGrads(const SetAsideGrads&) = delete;
  SetAsideGrads& operator=(const SetAsideGrads&) = delete;

 private:
  std::vector<at::Tensor> params_, grads_;
};

}  // namespace

BackwardOptimizer::BackwardOptimizer(torch::optim::Optimizer& optimizer, const std::vector<Unit*>& units, int rank)
    : optimizer_(optimizer) {
  TORCH_CHECK(dynamic_cast<torch::optim::LBFGS*>(&optimizer) == nullptr, "fsdp (rank ", rank,
              "): Options::optimizer_in_backward cannot step torch::optim::LBFGS: it re-evaluates the loss "
              "through a closure and needs every gradient at once. Use it with optimizer_in_backward(false)");
  const auto managed = managed_params(units);
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t j = 0; j < groups[g].params().size(); ++j) {
      const at::Tensor& p = groups[g].params()[j];
      TORCH_CHECK(managed.count(p.unsafeGetTensorImpl()), "fsdp (rank ", rank,
                  "): register_optimizer_in_backward: parameter ", j, " of the optimizer's group ", g, " (",
                  p.sizes(), ") is not a trainable parameter of this FullyShardedDataParallel's units (an ignored "
                  "module's, a frozen one or another model's), so no reduction in backward would step it. Build "
                  "the optimizer over model->parameters() of trainable, wrapped modules only");
    }
  }
}

void BackwardOptimizer::step(Unit& unit) {
  SetAsideGrads others(optimizer_);
  try {
    unit.step_reduced_shard([this] { optimizer_.step(); });
  } catch (const c10::OutOfMemoryError& e) {
    // A unit's first step creates its optimizer state (Adam: two shard-sized tensors).
    unit.out_of_memory(e, "stepping the optimizer (its state is created at the first step)", 0);
  }
}

}  // namespace fsdp::detail
