#include "backward_optimizer.h"

#include <unordered_set>
#include <utility>

#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include "unit.h"

namespace fsdp::core::detail {

namespace {

// The units' trainable parameters.
std::unordered_set<const c10::TensorImpl*> managed_params(const std::vector<Unit*>& units) {
  std::unordered_set<const c10::TensorImpl*> out;
  for (const Unit* u : units)
    for (const auto& e : u->flat().entries())
      if (e.param.requires_grad()) out.insert(e.param.unsafeGetTensorImpl());
  return out;
}

// Narrows each of the optimizer's groups to `unit`'s trainable parameters (in their
// order, a parameter listed twice kept twice) for its lifetime, then restores them: the
// step sees no other parameter, whatever gradient it holds (autograd's, of units still in
// backward; pieces of units not in this backward). The groups are read at each step, so
// that a group added after registration is narrowed too.
class StepOnly {
 public:
  StepOnly(torch::optim::Optimizer& optimizer, const Unit& unit) : optimizer_(optimizer) {
    std::unordered_set<const c10::TensorImpl*> mine;
    for (const auto& e : unit.flat().entries())
      if (e.param.requires_grad()) mine.insert(e.param.unsafeGetTensorImpl());
    for (auto& group : optimizer_.param_groups()) {
      std::vector<at::Tensor> narrowed;
      for (const auto& p : group.params())
        if (mine.count(p.unsafeGetTensorImpl())) narrowed.push_back(p);
      saved_.push_back(std::exchange(group.params(), std::move(narrowed)));
    }
  }
  ~StepOnly() {
    auto& groups = optimizer_.param_groups();
    for (size_t g = 0; g < saved_.size(); ++g) groups[g].params() = std::move(saved_[g]);
  }
  StepOnly(const StepOnly&) = delete;
  StepOnly& operator=(const StepOnly&) = delete;

 private:
  torch::optim::Optimizer& optimizer_;
  std::vector<std::vector<at::Tensor>> saved_;
};

}  // namespace

BackwardOptimizer::BackwardOptimizer(torch::optim::Optimizer& optimizer, const std::vector<Unit*>& units, int rank,
                                     bool on_host_thread)
    : optimizer_(optimizer),
      steps_(on_host_thread && !units.empty(),
             units.empty() ? c10::Device(c10::kCPU) : units.front()->flat().options().device()) {
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

BackwardOptimizer::~BackwardOptimizer() = default;

void BackwardOptimizer::step(Unit& unit) {
  // A unit on the device steps where its reduced shard is, now (its source may view a pooled
  // reduction buffer), after the host steps before it: they narrow the same groups.
  steps_.run([this, &unit] { step_now(unit); }, unit.flat().offloaded());
}

void BackwardOptimizer::step_now(Unit& unit) {
  StepOnly only(optimizer_, unit);
  try {
    unit.step_reduced_shard([this] { optimizer_.step(); });
  } catch (const c10::OutOfMemoryError& e) {
    // A unit's first step creates its optimizer state (Adam: two shard-sized tensors).
    unit.out_of_memory(e, "stepping the optimizer (its state is created at the first step)", 0);
  }
}

}  // namespace fsdp::core::detail
