// FSDP parity: training across N ranks under each strategy gives the model that
// single-process training on the global batch gives (fp32, relative L2 < 1e-5),
// with SGD (momentum) and AdamW (weight decay, no-decay group for biases), on an
// MLP (per-layer Sequential units) and a small transformer with nested units.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

enum class Opt { SGD, AdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, torch::nn::Module& m) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : m.named_parameters()) {
    if (p.key().find("bias") != std::string::npos) no_decay.push_back(p.value());
    else decay.push_back(p.value());
  }
  if (opt == Opt::SGD) {
    return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(1e-2).weight_decay(0.1)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(1e-2).weight_decay(0.0)));
  return std::make_unique<torch::optim::AdamW>(std::move(groups));
}

template <typename ModelFactory>
void check_parity(comm::ProcessGroup& pg, const std::string& name, ModelFactory make, Options options,
                  Opt opt, int steps = 6, int64_t batch = 12) {
  run_case(name, [&] {
    // Reference: unsharded, one process, global batch.
    auto ref = make();
    auto ref_opt = make_optimizer(opt, *ref.ptr());
    std::vector<double> ref_losses;
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = global_batch(s, batch);
      ref_opt->zero_grad(/*set_to_none=*/false);
      torch::Tensor loss = torch::mse_loss(ref->forward(x), y);
      loss.backward();
      ref_opt->step();
      ref_losses.push_back(loss.item<double>());
    }

    auto model = FullyShardedDataParallel(make(), pg, options);
    std::vector<const c10::TensorImpl*> identity;
    for (auto& p : model->parameters()) identity.push_back(p.unsafeGetTensorImpl());
    auto optim = make_optimizer(opt, *model);
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = global_batch(s, batch);
      optim->zero_grad(/*set_to_none=*/false);
      torch::Tensor loss = torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())),
                                  rank_slice(y, pg.rank(), pg.size()));
      loss.backward();
      optim->step();
      // The global loss is the mean of the ranks' losses (equal slices).
      auto l = loss.detach().to(torch::kDouble).reshape({1});
      comm::all_reduce(pg, l, comm::ReduceOp::kAvg).wait();
      EXPECT_NEAR(l.item<double>(), ref_losses[s], 1e-5 * std::abs(ref_losses[s]) + 1e-7) << "step " << s;
      // Outside forward/backward parameters are pieces (1-D) unless NO_SHARD.
      if (options.sharding_strategy() != ShardingStrategy::kNoShard && pg.size() > 1) {
        for (auto& p : model->parameters()) EXPECT_EQ(p.dim(), 1);
      }
    }
    // Identity of every parameter survives training.
    auto params = model->parameters();
    ASSERT_EQ(params.size(), identity.size());
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].unsafeGetTensorImpl(), identity[i]);

    auto full = full_params(model);
    for (const auto& p : ref->named_parameters()) {
      ASSERT_TRUE(full.count(p.key())) << p.key();
      EXPECT_LT(rel_diff(full[p.key()], p.value()), 1e-5) << p.key();
    }
  });
}

void parity_cases(comm::ProcessGroup& pg) {
  for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    const std::string s = to_string(strategy);
    for (Opt opt : {Opt::SGD, Opt::AdamW}) {
      const std::string o = opt == Opt::SGD ? "sgd" : "adamw";
      check_parity(pg, "mlp/" + s + "/" + o, [] { return make_mlp(); },
                   Options().sharding_strategy(strategy).auto_wrap_policy(always_wrap_policy()), opt);
      check_parity(pg, "transformer/" + s + "/" + o, [] { return make_transformer(); },
                   Options().sharding_strategy(strategy).auto_wrap_policy(size_based_policy(100)), opt);
    }
  }
  // One unit for the whole model (no policy).
  check_parity(pg, "mlp/root-only", [] { return make_mlp(); }, Options(), Opt::AdamW);
}

}  // namespace

TEST(FsdpParity, WorldSizes1To4) {
  for (int n = 1; n <= 4; ++n) run_ranks(n, parity_cases);
}

TEST(FsdpParity, UnitsFollowThePolicy) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto m = FullyShardedDataParallel(make_mlp(), pg, Options().auto_wrap_policy(always_wrap_policy()));
    // ReLUs have no parameters: no units for them; the root holds nothing.
    EXPECT_EQ(m->unit_paths(), (std::vector<std::string>{"0", "2", "4"}));
    auto t = FullyShardedDataParallel(make_transformer(), pg, Options().auto_wrap_policy(size_based_policy(100)));
    // Blocks' MLP layers are units inside block units; proj and head stay in the root.
    std::vector<std::string> expected{"", "block0", "block0.mlp.0", "block0.mlp.2",
                                      "block1", "block1.mlp.0", "block1.mlp.2"};
    EXPECT_EQ(t->unit_paths(), expected);
    auto by_type = FullyShardedDataParallel(make_transformer(), pg,
                                            Options().auto_wrap_policy(module_type_policy<BlockImpl>()));
    EXPECT_EQ(by_type->unit_paths(), (std::vector<std::string>{"", "block0", "block1"}));
    // Names are the unwrapped model's.
    auto names = m->named_parameters().keys();
    EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}));
  });
}
