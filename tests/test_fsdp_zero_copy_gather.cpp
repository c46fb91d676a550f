// Options::zero_copy_gather ([Note: zero-copy gathers] in src/core/flat_param.h) and the
// mapped flat buffer under it ([Note: mapped flat buffer] in include/fsdp/comm/mapped_flat.h).
// The reference for the buffer is an ordinary all-gather of the same chunks; for training,
// the same model trained with copying gathers: parameters, optimizer state and evaluation
// outputs bitwise equal after every step, for FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD,
// with the optimizer after backward and inside it, at 2-4 ranks, on units whose shards are
// smaller than a page (all seams) and larger (mapped pages), with checkpointed blocks and with
// a state dict loaded into the mapped shards between steps. Also: the refusals, the
// gather bytes that no longer move, and ranks that refresh out of step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/autograd/checkpoint_wrapper.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/mapped_flat.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/optim/cpu_adam.h"
#include "fsdp/state/state_dict.h"
#include "harness/error_of.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/same_params.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

// ---- the mapped flat buffer against an all-gather ----

at::Tensor chunk_values(int rank, int64_t numel, int round) {
  return torch::arange(numel, torch::kFloat) * 0.5 + 1000.0 * rank + 7.0 * round;
}

void mapped_flat_cases(comm::ProcessGroup& pg) {
  const int n = pg.size();
  // Chunks below a page, a page exactly, across pages at odd phases, large.
  for (int64_t numel : {int64_t(1), int64_t(100), int64_t(1024), int64_t(1500), int64_t(3001), int64_t(70000)}) {
    run_case("chunk " + std::to_string(numel), [&] {
      std::string why;
      auto m = comm::MappedFlat::create(pg, numel, torch::kFloat, {comm::Phase::kSetup, "test"}, &why);
      ASSERT_TRUE(m) << why;
      ASSERT_EQ(m->flat().numel(), n * numel);
      EXPECT_LE(m->seam_bytes(), (n + 1) * 4096);
      for (int round = 0; round < 3; ++round) {
        m->chunk().copy_(chunk_values(pg.rank(), numel, round));
        m->refresh({comm::Phase::kForward, "test"}).wait();
        auto expected = torch::empty({n * numel});
        comm::all_gather_into(pg, expected, chunk_values(pg.rank(), numel, round)).wait();
        EXPECT_TRUE(torch::equal(m->flat(), expected)) << "round " << round;
        // Nobody may write before every peer has compared.
        comm::barrier(pg);
      }
    });
  }
  run_case("ranks that refresh out of step are named", [&] {
    std::string why;
    auto a = comm::MappedFlat::create(pg, 10, torch::kFloat, {comm::Phase::kSetup, "a"}, &why);
    auto b = comm::MappedFlat::create(pg, 10, torch::kFloat, {comm::Phase::kSetup, "b"}, &why);
    ASSERT_TRUE(a && b) << why;
    a->refresh({comm::Phase::kForward, "a"}).wait();
    // Rank 0 gathers a again; the others gather b: the second rendezvous pairs them.
    auto& odd = pg.rank() == 0 ? *a : *b;
    const std::string err = error_of([&] { odd.refresh({comm::Phase::kForward, "odd"}).wait(); });
    EXPECT_NE(err.find("the ranks ran different forward or backward passes"), std::string::npos) << err;
    EXPECT_NE(err.find(pg.rank() == 0 ? "2 times, rank 1 1 times" : "1 times, rank 0 2 times"), std::string::npos) << err;
  });
}

void no_arena_cases(comm::ProcessGroup& pg) {
  std::string why;
  auto m = comm::MappedFlat::create(pg, 100, torch::kFloat, {comm::Phase::kSetup, "test"}, &why);
  EXPECT_FALSE(m);
  EXPECT_NE(why.find("has no exchange arena to map"), std::string::npos) << why;
}

// ---- FSDP training against copying gathers ----

// Units of 4-21 KB per shard at 2-4 ranks: their chunks cross pages at odd phases.
TinyTransformer make_wide_transformer() {
  torch::manual_seed(3);
  return TinyTransformer(13, 40, 5, 3);
}

struct Case {
  std::string name;
  Options options;
  bool in_backward = false;
  bool wide = true;
  bool checkpointed = false;  // every block recomputed in backward
  bool reload = false;        // a full state dict saved and loaded back between steps
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(torch::nn::Module& m, bool cpu_adam) {
  if (cpu_adam) return std::make_unique<optim::CPUAdam>(m.parameters(), optim::CPUAdamOptions(1e-2).weight_decay(0.01));
  return std::make_unique<torch::optim::AdamW>(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

void check_equal_to_copying_gathers(comm::ProcessGroup& pg, const Case& c) {
  run_case(c.name, [&] {
    auto make = [&] {
      auto m = c.wide ? make_wide_transformer() : make_transformer();
      if (c.checkpointed) {
        EXPECT_EQ(apply_activation_checkpointing(*m, checkpoint_module_type<BlockImpl>()), 3);
      }
      return m;
    };
    auto ref = FullyShardedDataParallel(make(), pg, Options(c.options).optimizer_in_backward(c.in_backward));
    auto model = FullyShardedDataParallel(
        make(), pg, Options(c.options).optimizer_in_backward(c.in_backward).zero_copy_gather(true));
    auto ref_opt = make_optimizer(*ref, c.in_backward);
    auto opt = make_optimizer(*model, c.in_backward);
    if (c.in_backward) {
      ref->register_optimizer_in_backward(*ref_opt);
      model->register_optimizer_in_backward(*opt);
    }
    int64_t ref_bytes = 0, bytes = 0;
    auto train_step = [&](auto& m, torch::optim::Optimizer& o, int step, int64_t& gathered) {
      o.zero_grad(true);
      auto [x, y] = global_batch(step, 12);
      const int64_t before = comm::comm_counters().all_gather;
      auto loss = torch::mse_loss(m->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()));
      loss.backward();
      gathered += comm::comm_counters().all_gather - before;
      o.step();
    };
    auto evaluate = [&](auto& m, int step) {
      torch::NoGradGuard no_grad;
      return m->forward(global_batch(100 + step, 12).first);
    };
    for (int s = 0; s < 4; ++s) {
      train_step(ref, *ref_opt, s, ref_bytes);
      train_step(model, *opt, s, bytes);
      const std::string where = c.name + " step " + std::to_string(s);
      expect_same_params(*model, *ref, where);
      EXPECT_TRUE(torch::equal(evaluate(model, s), evaluate(ref, s))) << where << ": evaluation output";
      if (c.reload) {
        // Written into the mapped shards without a collective: the peers read them only
        // after their next gather's rendezvous.
        auto saved = state_dict(*model);
        {
          torch::NoGradGuard no_grad;
          for (auto& p : model->parameters()) p.zero_();
        }
        load_state_dict(*model, saved);
      }
    }
    // The parameters' bytes no longer move: only the rendezvous' 8 bytes per rank.
    EXPECT_GT(ref_bytes, 0);
    EXPECT_LT(bytes * 100, ref_bytes) << "mapped " << bytes << " bytes, copying " << ref_bytes;
  });
}

void training_cases(comm::ProcessGroup& pg) {
  using S = ShardingStrategy;
  const auto blocks = size_based_policy(100);
  auto strategy = [&](S s) { return Options().sharding_strategy(s).auto_wrap_policy(blocks); };
  check_equal_to_copying_gathers(pg, {"full_shard/adamw", strategy(S::kFullShard)});
  check_equal_to_copying_gathers(pg, {"full_shard/cpu_adam in backward", strategy(S::kFullShard), true});
  check_equal_to_copying_gathers(pg, {"full_shard/small units (seams only)", strategy(S::kFullShard), false, false});
  check_equal_to_copying_gathers(pg, {"shard_grad_op/cpu_adam in backward", strategy(S::kShardGradOp), true});
  check_equal_to_copying_gathers(
      pg, {"full_shard/prefetch both ways", strategy(S::kFullShard).forward_prefetch(true)});
  check_equal_to_copying_gathers(
      pg, {"full_shard/checkpointed blocks/cpu_adam in backward", strategy(S::kFullShard), true, true, true});
  check_equal_to_copying_gathers(pg, {"full_shard/state dict reloaded every step", strategy(S::kFullShard), false,
                                      true, false, true});
  if (pg.size() % 2 == 0)
    check_equal_to_copying_gathers(pg, {"hybrid_shard/cpu_adam in backward",
                                        strategy(S::kHybridShard).shard_group_size(2), true});
}

void refusal_cases(comm::ProcessGroup& pg) {
  auto refused = [&](Options o) {
    return error_of([&] { FullyShardedDataParallel(make_transformer(), pg, o.zero_copy_gather(true)); });
  };
  std::string e = refused(Options().cpu_offload(true));
  EXPECT_NE(e.find("zero_copy_gather maps the peers' shards into the gathered parameters, but cpu_offload"),
            std::string::npos) << e;
  e = refused(Options().mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16)));
  EXPECT_NE(e.find("MixedPrecision::param_dtype gathers a cast copy"), std::string::npos) << e;
}

void gloo_refusal_cases(comm::ProcessGroup& pg) {
  const std::string e = error_of([&] {
    FullyShardedDataParallel(make_transformer(), pg, Options().zero_copy_gather(true));
  });
  EXPECT_NE(e.find("zero_copy_gather cannot map the shards of unit"), std::string::npos) << e;
  EXPECT_NE(e.find("has no exchange arena to map"), std::string::npos) << e;
  // NO_SHARD gathers nothing: the option changes nothing there.
  auto m = FullyShardedDataParallel(make_transformer(), pg,
                                    Options().sharding_strategy(ShardingStrategy::kNoShard).zero_copy_gather(true));
  EXPECT_TRUE(m->forward(global_batch(0, 4).first).defined());
}

}  // namespace

TEST(ZeroCopyGather, MappedFlatEqualsAllGather2To3Ranks) {
  for (int n : {2, 3}) run_ranks(n, mapped_flat_cases);
}

TEST(ZeroCopyGather, MappedFlatNeedsSharedMemory) {
  RankOptions o;
  o.extra_env = {"FSDP_SHM_DIRECT=0"};
  run_ranks(2, no_arena_cases, o);
}

TEST(ZeroCopyGather, TrainsBitwiseLikeCopyingGathers2To4Ranks) {
  for (int n : {2, 3, 4}) run_ranks(n, training_cases);
}

TEST(ZeroCopyGather, Refusals) {
  run_ranks(2, refusal_cases);
  RankOptions o;
  o.extra_env = {"FSDP_SHARED_MEMORY=0"};
  run_ranks(2, gloo_refusal_cases, o);
}
