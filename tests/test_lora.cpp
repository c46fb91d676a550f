// LoRALinear (fsdp/core/lora_linear.h): a fresh adapter computes its Linear, merged_weight is
// W + s B A, only A and B get gradients; and under FullyShardedDataParallel in every sharding
// strategy at N = 1..3, 20 Adam steps train the adapters as the same model trained unsharded
// in one process does, with the frozen W and b bitwise unchanged and no gradient held for
// them ([Note: frozen companions] in src/core/runtime.h).
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include <torch/torch.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/lora_linear.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

torch::nn::Sequential make_lora_mlp() {
  torch::manual_seed(3);
  torch::nn::Sequential net(LoRALinear(LoRALinearOptions(13, 32).rank(4).alpha(8)), torch::nn::ReLU(),
                            LoRALinear(LoRALinearOptions(32, 17).rank(4).alpha(8)), torch::nn::ReLU(),
                            torch::nn::Linear(17, 5));
  // Non-zero adapters from the start, so that A's first gradients are not zero.
  torch::NoGradGuard no_grad;
  for (const auto& p : net->named_parameters())
    if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0, 0.1);
  return net;
}

std::map<std::string, torch::Tensor> snapshot_of(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

TEST(LoRALinear, AFreshAdapterIsItsLinearAndMergesInClosedForm) {
  torch::manual_seed(0);
  torch::nn::Linear linear(6, 4);
  LoRALinear layer(LoRALinearOptions(6, 4).rank(2).alpha(3));
  layer->load_linear(linear);
  const auto x = torch::randn({5, 6});
  EXPECT_TRUE(torch::equal(layer->forward(x), linear->forward(x))) << "B starts at zero";
  {
    torch::NoGradGuard no_grad;
    layer->lora_B.normal_();
  }
  const auto want = linear->weight + 1.5 * layer->lora_B.mm(layer->lora_A);
  EXPECT_TRUE(torch::allclose(layer->merged_weight(), want, 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(layer->forward(x), torch::nn::functional::linear(x, want, linear->bias), 1e-5, 1e-5));
  layer->forward(x).sum().backward();
  EXPECT_TRUE(layer->lora_A.grad().defined() && layer->lora_B.grad().defined());
  EXPECT_FALSE(layer->weight.grad().defined());
  EXPECT_FALSE(layer->bias.grad().defined());
  EXPECT_THROW(LoRALinear(LoRALinearOptions(6, 4).rank(5)), c10::Error);
}

void train_adam(torch::nn::Module& m, const std::function<torch::Tensor(const torch::Tensor&)>& fwd,
                torch::optim::Adam& opt, int step, const comm::ProcessGroup* pg) {
  auto [x, y] = global_batch(step, 12);
  if (pg) {
    x = rank_slice(x, pg->rank(), pg->size());
    y = rank_slice(y, pg->rank(), pg->size());
  }
  opt.zero_grad(/*set_to_none=*/true);
  torch::mse_loss(fwd(x), y).backward();
  opt.step();
}

void lora_cases(comm::ProcessGroup& pg) {
  for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    run_case(std::string("lora/") + to_string(strategy), [&] {
      auto ref = make_lora_mlp();
      const auto initial = snapshot_of(*ref);
      torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
      auto model = FullyShardedDataParallel(make_lora_mlp(), pg,
                                            Options().sharding_strategy(strategy).auto_wrap_policy(always_wrap_policy()));
      EXPECT_EQ(model->unit_paths(), (std::vector<std::string>{"0", "0 (frozen)", "2", "2 (frozen)", "4"}));
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
      for (int s = 0; s < 20; ++s) {
        train_adam(*ref, [&](const torch::Tensor& x) { return ref->forward(x); }, ref_opt, s, nullptr);
        train_adam(*model, [&](const torch::Tensor& x) { return model->forward(x); }, opt, s, &pg);
        for (const auto& p : model->named_parameters())
          if (!p.value().requires_grad()) EXPECT_FALSE(p.value().grad().defined()) << p.key();
      }
      const auto got = full_params(model);
      const auto want = snapshot_of(*ref);
      for (const auto& [name, w] : want) {
        if (!ref->named_parameters()[name].requires_grad()) {
          EXPECT_TRUE(torch::equal(got.at(name), initial.at(name))) << name << " (frozen) changed";
        } else {
          EXPECT_FALSE(torch::equal(w, initial.at(name))) << name << " did not train";
          EXPECT_LT(rel_diff(got.at(name), w), 1e-6) << name << " rel " << rel_diff(got.at(name), w);
        }
      }
    });
  }
}

}  // namespace

TEST(LoRALinear, FsdpTrainsTheAdaptersAsUnshardedAtN1To3) {
  for (int n = 1; n <= 3; ++n) run_ranks(n, lora_cases);
}
