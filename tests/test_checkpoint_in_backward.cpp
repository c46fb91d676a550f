// The two features that meet inside backward, together (docs/architecture.md, "The combinations"):
// activation checkpointing (a unit's forward recomputed, its gradients arriving inside a
// nested backward) with the optimizer inside backward (each unit's shard stepped at its
// final reduction). The reference is the plainest training of the same model: no
// checkpoint, the optimizer stepping after backward. Parameters must be bitwise equal after
// every step, and no gradient may be left after a stepping backward: FSDP FULL_SHARD and
// SHARD_GRAD_OP with Adam and an LR that changes every step, at N=1..3, and ZeRO-2 with
// AdamW at N=2.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "fsdp/autograd/checkpoint_wrapper.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

void expect_same_params(torch::nn::Module& a, torch::nn::Module& b, const std::string& where) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i].key(), pb[i].key());
    EXPECT_TRUE(torch::equal(pa[i].value(), pb[i].value())) << where << ": " << pa[i].key() << " differs";
  }
}

// TinyTransformer's blocks are Wrappable, so each is a unit and a checkpoint candidate.
TinyTransformer checkpointed_transformer() {
  auto m = make_transformer();
  EXPECT_EQ(apply_activation_checkpointing(*m, checkpoint_module_type<BlockImpl>()), 2);
  return m;
}

torch::Tensor loss_of(torch::Tensor out, const torch::Tensor& y, const comm::ProcessGroup& pg) {
  return torch::mse_loss(out.to(torch::kFloat), rank_slice(y, pg.rank(), pg.size()));
}

void fsdp_case(comm::ProcessGroup& pg, ShardingStrategy strategy) {
  run_case(std::string("fsdp/") + to_string(strategy), [&] {
    const Options base = Options().sharding_strategy(strategy).auto_wrap_policy(size_based_policy(100));
    auto ref = FullyShardedDataParallel(make_transformer(), pg, base);
    auto model = FullyShardedDataParallel(checkpointed_transformer(), pg, Options(base).optimizer_in_backward(true));
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    model->register_optimizer_in_backward(opt);
    torch::optim::StepLR ref_sched(ref_opt, 1, 0.8), sched(opt, 1, 0.8);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 12);
      const auto xs = rank_slice(x, pg.rank(), pg.size());
      ref_opt.zero_grad(/*set_to_none=*/true);
      loss_of(ref->forward(xs), y, pg).backward();
      ref_opt.step();
      ref_sched.step();
      opt.zero_grad(/*set_to_none=*/true);
      loss_of(model->forward(xs), y, pg).backward();
      opt.step();  // nothing left to step
      sched.step();
      const std::string where = "step " + std::to_string(step);
      expect_same_params(*model, *ref, where);
      for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << where;
    }
  });
}

void zero2_case(comm::ProcessGroup& pg) {
  run_case("zero2", [&] {
    struct Run {
      TinyTransformer net{nullptr};
      std::unique_ptr<optim::ZeroRedundancyOptimizer> opt;
    };
    auto make = [&](bool checkpointed_in_backward) {
      Run r;
      r.net = checkpointed_in_backward ? checkpointed_transformer() : make_transformer();
      r.opt = std::make_unique<optim::ZeroRedundancyOptimizer>(
          r.net->parameters(), optim::inner_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2)),
          optim::ZeroOptions().process_group(pg).stage(2).reduce_bucket_size(300).module(r.net.ptr())
              .optimizer_in_backward(checkpointed_in_backward));
      return r;
    };
    Run ref = make(false), in = make(true);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 12);
      for (Run* r : {&ref, &in}) {
        r->opt->zero_grad(/*set_to_none=*/true);
        loss_of(r->net->forward(rank_slice(x, pg.rank(), pg.size())), y, pg).backward();
        r->opt->step();
      }
      expect_same_params(*in.net, *ref.net, "step " + std::to_string(step));
    }
  });
}

TEST(CheckpointInBackward, FsdpEqualsPlainTrainingAtOneToThreeRanks) {
  for (int n = 1; n <= 3; ++n) {
    run_ranks(n, [](comm::ProcessGroup& pg) {
      fsdp_case(pg, ShardingStrategy::kFullShard);
      fsdp_case(pg, ShardingStrategy::kShardGradOp);
    });
  }
}

TEST(CheckpointInBackward, ZeroStage2EqualsPlainTraining) {
  run_ranks(2, [](comm::ProcessGroup& pg) { zero2_case(pg); });
}

}  // namespace
