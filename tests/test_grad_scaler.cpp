// DynamicGradScaler's state machine against hand-computed sequences, its
// checkpoint state, and ShardedGradScaler across ranks: an inf injected into one
// rank's gradient makes every rank skip the step, parameters and optimizer state
// unchanged bit for bit; a clean step runs and matches an unscaled reference.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/precision/grad_scaler.h"
#include "harness/bit_equal.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::precision;
using namespace fsdp::testing;

namespace {

struct Expect {
  bool overflow;
  double scale;
  int64_t growth, hyst;
};

void run_sequence(DynamicGradScaler& s, const std::vector<Expect>& seq) {
  for (size_t i = 0; i < seq.size(); ++i) {
    s.update(seq[i].overflow);
    SCOPED_TRACE("step " + std::to_string(i));
    EXPECT_EQ(s.scale(), seq[i].scale);
    EXPECT_EQ(s.state().growth_step, seq[i].growth);
    EXPECT_EQ(s.state().hysteresis_step, seq[i].hyst);
  }
}

}  // namespace

TEST(GradScaler, DefaultsAreShardedOptimizerV2s) {
  DynamicGradScalerOptions o;
  EXPECT_EQ(o.initial_scale(), 4294967296.0);
  EXPECT_EQ(o.min_scale(), 1.0);
  EXPECT_EQ(o.growth_factor(), 2.0);
  EXPECT_EQ(o.backoff_factor(), 0.5);
  EXPECT_EQ(o.growth_interval(), 1000);
  EXPECT_EQ(o.hysteresis(), 2);
  EXPECT_EQ(o.max_scale(), 4294967296.0);
  DynamicGradScaler s;
  EXPECT_EQ(s.scale(), 4294967296.0);
}

TEST(GradScaler, HysteresisCountsOverflowsAcrossCleanSteps) {
  DynamicGradScaler s(DynamicGradScalerOptions().initial_scale(1024).growth_interval(3).max_scale(1 << 20));
  // inf, clean, inf: the second inf reaches hysteresis 2 and backs off; later
  // overflows back off each time until a growth resets the counter.
  run_sequence(s, {{true, 1024, 0, 1},
                   {false, 1024, 1, 1},
                   {true, 512, 0, 2},
                   {true, 256, 0, 3},
                   {false, 256, 1, 3},
                   {false, 256, 2, 3},
                   {false, 512, 0, 0},   // 3 consecutive clean steps: grow, reset both
                   {true, 512, 0, 1},    // first overflow after growth: tolerated
                   {false, 512, 1, 1},
                   {false, 512, 2, 1},
                   {true, 256, 0, 2}});  // growth interrupted; second overflow backs off
}

TEST(GradScaler, ClampsAtMinAndMax) {
  DynamicGradScaler s(DynamicGradScalerOptions()
                          .initial_scale(4)
                          .min_scale(2)
                          .max_scale(8)
                          .hysteresis(1)
                          .growth_interval(1)
                          .growth_factor(4)
                          .backoff_factor(0.25));
  run_sequence(s, {{true, 2, 0, 1},    // 4 * 0.25 = 1 -> clamped to min 2
                   {true, 2, 0, 2},
                   {false, 8, 0, 0},   // 2 * 4 = 8 = max
                   {false, 8, 0, 0},   // 32 -> clamped to max 8
                   {true, 2, 0, 1}});
}

TEST(GradScaler, StateRoundTripsThroughDict) {
  DynamicGradScaler a(DynamicGradScalerOptions().initial_scale(64).growth_interval(5));
  for (bool o : {true, false, false, true, false}) a.update(o);
  auto d = a.state().to_dict();
  DynamicGradScaler b(DynamicGradScalerOptions().initial_scale(64).growth_interval(5));
  b.load_state(GradScalerState::from_dict(d));
  EXPECT_EQ(b.state(), a.state());
  for (bool o : {false, false, true, true, false, false, false, false, false}) {
    a.update(o);
    b.update(o);
    EXPECT_EQ(b.state(), a.state());
  }
  c10::Dict<std::string, torch::Tensor> bad;
  EXPECT_THROW(GradScalerState::from_dict(bad), c10::Error);
}

TEST(GradScaler, RejectsBadOptions) {
  EXPECT_THROW(DynamicGradScaler(DynamicGradScalerOptions().hysteresis(0)), c10::Error);
  EXPECT_THROW(DynamicGradScaler(DynamicGradScalerOptions().backoff_factor(1.5)), c10::Error);
  EXPECT_THROW(DynamicGradScaler(DynamicGradScalerOptions().initial_scale(0.5)), c10::Error);
  EXPECT_THROW(DynamicGradScaler(DynamicGradScalerOptions().max_scale(0.5)), c10::Error);
}

namespace {

std::vector<torch::Tensor> snapshot_params(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

std::vector<torch::Tensor> snapshot_adam(torch::optim::Adam& opt) {
  std::vector<torch::Tensor> out;
  for (auto& g : opt.param_groups())
    for (auto& p : g.params()) {
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      auto& st = static_cast<torch::optim::AdamParamState&>(*it->second);
      out.push_back(st.exp_avg().clone());
      out.push_back(st.exp_avg_sq().clone());
      out.push_back(torch::tensor(st.step()));
    }
  return out;
}

}  // namespace

TEST(GradScaler, InfOnOneRankSkipsTheStepEverywhere) {
  for (int world : {2, 3}) {
    run_ranks(world, [](comm::ProcessGroup& pg) {
      run_case("skip_and_resume", [&] {
        auto ref = make_mlp(5);
        torch::optim::Adam ref_opt(ref->parameters(), 1e-2);
        auto model = FullyShardedDataParallel(make_mlp(5), pg,
                                              Options().auto_wrap_policy(always_wrap_policy()));
        torch::optim::Adam opt(model->parameters(), 1e-2);
        ShardedGradScaler scaler(pg, DynamicGradScalerOptions().initial_scale(1024).hysteresis(1));
        const int64_t batch = 6 * pg.size();
        for (int s = 0; s < 4; ++s) {
          auto [x, y] = global_batch(s, batch);
          opt.zero_grad(/*set_to_none=*/false);
          auto loss = torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())),
                                      rank_slice(y, pg.rank(), pg.size()));
          scaler.scale(loss).backward();
          const bool inject = s == 2;
          if (inject && pg.rank() == pg.size() - 1) {
            // Poison one element of this rank's gradient shard only.
            for (auto& p : model->parameters())
              if (p.grad().defined() && p.grad().numel() > 0) {
                p.grad().view(-1)[0] = std::numeric_limits<float>::infinity();
                break;
              }
          }
          auto params_before = snapshot_params(*model);
          auto adam_before = snapshot_adam(opt);
          scaler.unscale_(opt);
          model->clip_grad_norm_(1e9);  // after unscale_, as documented
          const bool stepped = scaler.step(opt);
          scaler.update();
          EXPECT_EQ(stepped, !inject) << "step " << s;
          if (inject) {
            EXPECT_TRUE(bit_equal(params_before, snapshot_params(*model))) << "parameters changed";
            EXPECT_TRUE(bit_equal(adam_before, snapshot_adam(opt))) << "Adam state changed";
            EXPECT_EQ(scaler.get_scale(), 512);  // hysteresis 1: backed off at once
          } else {
            ref_opt.zero_grad(/*set_to_none=*/false);
            torch::mse_loss(ref->forward(x), y).backward();
            ref_opt.step();
          }
        }
        // The skipped step left no trace: same as three clean reference steps.
        auto full = full_params(model);
        for (const auto& p : ref->named_parameters())
          EXPECT_LT(rel_diff(full.at(p.key()), p.value()), 1e-5) << p.key();
      });
    });
  }
}
