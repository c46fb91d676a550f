// Options::optimizer_in_backward ([Note: optimizer in backward] in
// src/core/backward_optimizer.h): each unit's shard stepped inside backward by the
// user's optimizer. The reference is the same training stepping after backward
// (a second model, same options but the flag): parameters and optimizer state must be
// bitwise equal after every step, for every strategy at 1-4 ranks, with SGD, Adam,
// AdamW (groups spanning units), CPUAdam, accumulation (no_sync and no_step), tied
// weights, buckets, mixed precision and an LR scheduler that changes the LR every
// step. Also: the refusals, the unit lifecycle's new arrows, and the gradient memory.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <set>
#include <thread>

#include "core/counting_allocator.h"
#include "core/unit.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/optim/cpu_adam.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/trainer/training_facade.h"
#include "harness/error_of.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/same_params.h"

using namespace fsdp;
using namespace fsdp::testing;
using fsdp::memory::install_counting_allocator;

namespace {

enum class Opt { SGD, Adam, AdamW, CPUAdam };

// Two groups that each span several units: weights (decayed) and biases (not).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, torch::nn::Module& m) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : m.named_parameters()) {
    if (!p.value().requires_grad()) continue;
    (p.key().find("bias") != std::string::npos ? no_decay : decay).push_back(p.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto add = [&](std::vector<torch::Tensor>& ps, auto options) {
    if (!ps.empty()) groups.emplace_back(ps, std::make_unique<decltype(options)>(options));
  };
  switch (opt) {
    case Opt::SGD:
      add(decay, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
      add(no_decay, torch::optim::SGDOptions(0.05).momentum(0.9));
      return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(0.05));
    case Opt::Adam:
      add(decay, torch::optim::AdamOptions(1e-2).weight_decay(0.01));
      add(no_decay, torch::optim::AdamOptions(1e-2));
      return std::make_unique<torch::optim::Adam>(std::move(groups));
    case Opt::AdamW:
      add(decay, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      add(no_decay, torch::optim::AdamWOptions(1e-2).weight_decay(0.0));
      return std::make_unique<torch::optim::AdamW>(std::move(groups));
    case Opt::CPUAdam:
      add(decay, optim::CPUAdamOptions(1e-2).weight_decay(0.1).adamw_mode(true));
      add(no_decay, optim::CPUAdamOptions(1e-2).adamw_mode(true));
      return std::make_unique<optim::CPUAdam>(std::move(groups));
  }
  return nullptr;
}

// Bitwise equality of two optimizers' per-parameter state, parameter by parameter in
// group order (the two optimizers hold different but corresponding parameters).
void expect_same_state(torch::optim::Optimizer& a, torch::optim::Optimizer& b, const std::string& where) {
  auto same = [&](const torch::Tensor& x, const torch::Tensor& y, const char* what) {
    ASSERT_EQ(x.defined(), y.defined()) << where << ": " << what;
    if (x.defined()) {
      EXPECT_TRUE(torch::equal(x, y)) << where << ": " << what << " differs";
    }
  };
  ASSERT_EQ(a.param_groups().size(), b.param_groups().size());
  for (size_t g = 0; g < a.param_groups().size(); ++g) {
    const auto& pa = a.param_groups()[g].params();
    const auto& pb = b.param_groups()[g].params();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t j = 0; j < pa.size(); ++j) {
      auto ia = a.state().find(pa[j].unsafeGetTensorImpl());
      auto ib = b.state().find(pb[j].unsafeGetTensorImpl());
      ASSERT_EQ(ia == a.state().end(), ib == b.state().end()) << where << ": state of group " << g << " param " << j;
      if (ia == a.state().end()) continue;
      if (auto* sa = dynamic_cast<torch::optim::AdamParamState*>(ia->second.get())) {
        auto* sb = dynamic_cast<torch::optim::AdamParamState*>(ib->second.get());
        ASSERT_NE(sb, nullptr);
        EXPECT_EQ(sa->step(), sb->step()) << where;
        same(sa->exp_avg(), sb->exp_avg(), "exp_avg");
        same(sa->exp_avg_sq(), sb->exp_avg_sq(), "exp_avg_sq");
      } else if (auto* wa = dynamic_cast<torch::optim::AdamWParamState*>(ia->second.get())) {
        auto* wb = dynamic_cast<torch::optim::AdamWParamState*>(ib->second.get());
        ASSERT_NE(wb, nullptr);
        EXPECT_EQ(wa->step(), wb->step()) << where;
        same(wa->exp_avg(), wb->exp_avg(), "exp_avg");
        same(wa->exp_avg_sq(), wb->exp_avg_sq(), "exp_avg_sq");
      } else if (auto* ga = dynamic_cast<torch::optim::SGDParamState*>(ia->second.get())) {
        auto* gb = dynamic_cast<torch::optim::SGDParamState*>(ib->second.get());
        ASSERT_NE(gb, nullptr);
        same(ga->momentum_buffer(), gb->momentum_buffer(), "momentum_buffer");
      } else {
        ADD_FAILURE() << where << ": unexpected state class";
      }
    }
  }
}

/// How the micro-batches of one step are accumulated.
enum class Accumulate { None, NoSync, NoStep };

struct Case {
  std::string name;
  Options options;
  Opt opt = Opt::AdamW;
  Accumulate accumulate = Accumulate::None;
  int micro_batches = 1;
  int steps = 4;
};

// Trains `make()` twice, stepping in backward and after it, and compares bitwise
// after every step. The LR changes every step (StepLR, gamma 0.8).
template <typename ModelFactory, typename Batch>
void check_equal_to_step_after_backward(comm::ProcessGroup& pg, const Case& c, ModelFactory make, Batch batch) {
  run_case(c.name, [&] {
    auto ref = FullyShardedDataParallel(make(), pg, Options(c.options).optimizer_in_backward(false));
    auto model = FullyShardedDataParallel(make(), pg, Options(c.options).optimizer_in_backward(true));
    auto ref_opt = make_optimizer(c.opt, *ref);
    auto opt = make_optimizer(c.opt, *model);
    model->register_optimizer_in_backward(*opt);
    torch::optim::StepLR ref_sched(*ref_opt, 1, 0.8), sched(*opt, 1, 0.8);
    auto run_step = [&](auto& m, torch::optim::Optimizer& o, torch::optim::StepLR& s, bool in_backward, int step) {
      o.zero_grad(/*set_to_none=*/true);
      for (int k = 0; k < c.micro_batches; ++k) {
        const bool last = k + 1 == c.micro_batches;
        std::optional<FullyShardedBase::NoSyncGuard> no_sync;
        std::optional<FullyShardedBase::NoStepGuard> no_step;
        if (!last && c.accumulate == Accumulate::NoSync) no_sync.emplace(m->no_sync());
        if (!last && c.accumulate == Accumulate::NoStep && in_backward) no_step.emplace(m->no_step());
        auto [x, y] = batch(step * c.micro_batches + k);
        auto out = m->forward(rank_slice(x, pg.rank(), pg.size())).to(torch::kFloat);
        auto loss = torch::mse_loss(out, rank_slice(y, pg.rank(), pg.size()));
        (loss / double(c.micro_batches)).backward();
      }
      o.step();  // a no-op after a backward that stepped
      s.step();
    };
    for (int s = 0; s < c.steps; ++s) {
      run_step(ref, *ref_opt, ref_sched, false, s);
      run_step(model, *opt, sched, true, s);
      const std::string where = "step " + std::to_string(s);
      expect_same_params(*model, *ref, where);
      // Nothing is left to read after such a backward: no gradient is defined.
      for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << where;
    }
    expect_same_state(*opt, *ref_opt, c.name);
    EXPECT_EQ(opt->param_groups()[0].options().get_lr(), ref_opt->param_groups()[0].options().get_lr());
  });
}

Options hybrid(int n) {
  return Options().sharding_strategy(ShardingStrategy::kHybridShard).shard_group_size(n % 2 == 0 ? 2 : n);
}


void equality_cases(comm::ProcessGroup& pg) {
  const int n = pg.size();
  auto mlp = [] { return make_mlp(); };
  auto transformer = [] { return make_transformer(); };
  auto batch = [](int64_t s) { return global_batch(s, 12); };
  auto tied_batch = [](int64_t s) {
    auto g = at::detail::createCPUGenerator(2000 + s);
    auto x = torch::randn({12, kTiedVocab}, g);
    return std::make_pair(x, torch::randn({12, kTiedVocab}, g));
  };
  const auto each = always_wrap_policy();
  const auto blocks = size_based_policy(100);
  using S = ShardingStrategy;
  auto strategy = [](S s) { return Options().sharding_strategy(s); };
  check_equal_to_step_after_backward(pg, {"mlp/full_shard/adamw", strategy(S::kFullShard).auto_wrap_policy(each), Opt::AdamW},
                                     mlp, batch);
  check_equal_to_step_after_backward(
      pg, {"transformer/shard_grad_op/sgd", strategy(S::kShardGradOp).auto_wrap_policy(blocks), Opt::SGD}, transformer,
      batch);
  check_equal_to_step_after_backward(pg, {"transformer/no_shard/adam", strategy(S::kNoShard).auto_wrap_policy(blocks), Opt::Adam},
                                     transformer, batch);
  check_equal_to_step_after_backward(pg, {"transformer/hybrid_shard/cpu_adam", hybrid(n).auto_wrap_policy(blocks), Opt::CPUAdam},
                                     transformer, batch);
  // Accumulation: only the last micro-batch steps.
  check_equal_to_step_after_backward(
      pg, {"mlp/full_shard/adam/no_sync x3", strategy(S::kFullShard).auto_wrap_policy(each), Opt::Adam, Accumulate::NoSync, 3, 3},
      mlp, batch);
  check_equal_to_step_after_backward(
      pg, {"transformer/full_shard/sgd/no_step x3", strategy(S::kFullShard).auto_wrap_policy(blocks), Opt::SGD, Accumulate::NoStep, 3, 3},
      transformer, batch);
  check_equal_to_step_after_backward(
      pg, {"mlp/no_shard/cpu_adam/no_step x2", strategy(S::kNoShard).auto_wrap_policy(each), Opt::CPUAdam, Accumulate::NoStep, 2, 3},
      mlp, batch);
  // Tied weights (one unit), buckets of several units, mixed precision.
  check_equal_to_step_after_backward(pg, {"tied/full_shard/adamw", strategy(S::kFullShard), Opt::AdamW}, [] { return TiedEmbeddingNet(3); },
                                     tied_batch);
  check_equal_to_step_after_backward(
      pg, {"mlp/full_shard/adamw/buckets", strategy(S::kFullShard).auto_wrap_policy(each).bucket_cap_mb(1), Opt::AdamW}, mlp, batch);
  check_equal_to_step_after_backward(
      pg, {"transformer/full_shard/adamw/bf16",
           strategy(S::kFullShard).auto_wrap_policy(blocks).mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16)),
           Opt::AdamW},
      transformer, batch);
}

void refusal_cases(comm::ProcessGroup& pg) {
  const auto on = Options().auto_wrap_policy(always_wrap_policy()).optimizer_in_backward(true);
  run_case("registering without the option", [&] {
    auto m = FullyShardedDataParallel(make_mlp(), pg, Options().auto_wrap_policy(always_wrap_policy()));
    torch::optim::SGD o(m->parameters(), 0.1);
    EXPECT_NE(error_of([&] { m->register_optimizer_in_backward(o); }).find("optimizer_in_backward(true)"),
              std::string::npos);
    EXPECT_NE(error_of([&] { auto g = m->no_step(); }).find("optimizer_in_backward(true)"), std::string::npos);
  });
  run_case("training forward without an optimizer", [&] {
    auto m = FullyShardedDataParallel(make_mlp(), pg, on);
    auto [x, y] = global_batch(0, 4);
    EXPECT_NE(error_of([&] { m->forward(x); }).find("register_optimizer_in_backward"), std::string::npos);
    torch::NoGradGuard no_grad;  // evaluation needs no optimizer
    EXPECT_EQ(error_of([&] { m->forward(x); }), "");
  });
  run_case("LBFGS and foreign parameters", [&] {
    auto m = FullyShardedDataParallel(make_mlp(), pg, on);
    torch::optim::LBFGS lbfgs(m->parameters(), 0.1);
    EXPECT_NE(error_of([&] { m->register_optimizer_in_backward(lbfgs); }).find("LBFGS"), std::string::npos);
    auto params = m->parameters();
    params.push_back(torch::zeros({3}, torch::requires_grad()));
    torch::optim::SGD foreign(params, 0.1);
    const std::string e = error_of([&] { m->register_optimizer_in_backward(foreign); });
    EXPECT_NE(e.find("parameter " + std::to_string(params.size() - 1) + " of the optimizer's group 0"),
              std::string::npos)
        << e;
  });
  run_case("clip_grad_norm_ after a backward that stepped", [&] {
    auto m = FullyShardedDataParallel(make_mlp(), pg, on);
    torch::optim::Adam o(m->parameters(), 1e-3);
    m->register_optimizer_in_backward(o);
    auto [x, y] = global_batch(0, 4 * pg.size());
    torch::mse_loss(m->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())).backward();
    EXPECT_NE(error_of([&] { m->clip_grad_norm_(1.0); }).find("optimizer_in_backward"), std::string::npos);
  });
  run_case("zero: stage 1, clipping, a second backward before step()", [&] {
    auto net = make_mlp();
    auto inner = optim::inner_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1));
    auto base = optim::ZeroOptions().process_group(pg).optimizer_in_backward(true);
    EXPECT_NE(error_of([&] { optim::ZeroRedundancyOptimizer(net->parameters(), inner, optim::ZeroOptions(base).stage(1)); })
                  .find("needs stage 2"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                optim::ZeroRedundancyOptimizer(net->parameters(), inner, optim::ZeroOptions(base).stage(2).clip_grad_norm(1));
              }).find("clip_grad_norm needs every gradient"),
              std::string::npos);
    optim::ZeroRedundancyOptimizer z(net->parameters(), inner, optim::ZeroOptions(base).stage(2));
    auto [x, y] = global_batch(0, 4 * pg.size());
    auto loss = [&] { return torch::mse_loss(net->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())); };
    loss().backward();
    EXPECT_NE(error_of([&] { loss().backward(); }).find("call step() after every backward"), std::string::npos);
  });
  run_case("zero: a step on the host thread fails; step() says so", [&] {
    // cpu_offload steps each bucket on a host thread ([Note: host steps]): its error surfaces
    // at step(), the thread skips the steps after it, and the optimizer still closes.
    struct FailingSGD : torch::optim::SGD {
      using torch::optim::SGD::SGD;
      torch::Tensor step(LossClosure) override { TORCH_CHECK(false, "the inner step failed on purpose"); }
    };
    auto net = make_mlp();
    optim::InnerOptimizerFactory failing = [](std::vector<torch::optim::OptimizerParamGroup> groups) {
      return std::unique_ptr<torch::optim::Optimizer>(new FailingSGD(groups, torch::optim::SGDOptions(0.1)));
    };
    optim::ZeroRedundancyOptimizer z(net->parameters(), failing,
                                     optim::ZeroOptions().process_group(pg).stage(2).reduce_bucket_size(300)
                                         .optimizer_in_backward(true).cpu_offload(true));
    auto [x, y] = global_batch(0, 4 * pg.size());
    torch::mse_loss(net->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())).backward();
    EXPECT_NE(error_of([&] { z.step(); }).find("the inner step failed on purpose"), std::string::npos);
  });
  run_case("TrainingFacade registers the optimizer, refuses the scaler and clipping", [&] {
    auto m = FullyShardedDataParallel(make_mlp(), pg, on);
    torch::optim::SGD o(m->parameters(), 0.1);
    EXPECT_NE(error_of([&] { trainer::TrainingFacade(*m, o, trainer::FacadeOptions().clip_grad_norm(1)); })
                  .find("clip_grad_norm needs every gradient"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                trainer::TrainingFacade(*m, o, trainer::FacadeOptions().dynamic_loss_scale(
                                                     optim::ZeroOptions::low_level_zero_scaler()));
              }).find("dynamic_loss_scale (its inf/nan check) needs every gradient"),
              std::string::npos);
    trainer::TrainingFacade train(*m, o);
    std::vector<torch::Tensor> before;
    for (auto& p : m->parameters()) before.push_back(p.detach().clone());
    auto [x, y] = global_batch(0, 4 * pg.size());
    train.zero_grad(/*set_to_none=*/true);
    train.backward(torch::mse_loss(m->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())));
    bool changed = false;  // by backward itself
    auto params = m->parameters();
    for (size_t i = 0; i < params.size(); ++i) changed = changed || !torch::equal(params[i], before[i]);
    EXPECT_TRUE(changed);
    EXPECT_TRUE(train.step());
  });
  run_case("no_sync steps nothing", [&] {
    auto m = FullyShardedDataParallel(make_mlp(), pg, on);
    torch::optim::SGD o(m->parameters(), 0.1);
    m->register_optimizer_in_backward(o);
    std::vector<torch::Tensor> before;
    for (auto& p : m->parameters()) before.push_back(p.detach().clone());
    auto [x, y] = global_batch(0, 4 * pg.size());
    {
      auto guard = m->no_sync();
      torch::mse_loss(m->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())).backward();
    }
    auto params = m->parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i]));
    // The next backward, outside no_sync, steps with the accumulated gradients.
    torch::mse_loss(m->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())).backward();
    bool changed = false;
    for (size_t i = 0; i < params.size(); ++i) changed = changed || !torch::equal(params[i], before[i]);
    EXPECT_TRUE(changed);
  });
}

// ZeRO-2 (ZeroOptions::optimizer_in_backward): each bucket's chunk stepped as its
// reduce-scatter completes, against the same optimizer stepping in step(). Small buckets
// (300 elements: several per layer, and layers split across buckets), two groups, and a
// parameter no rank uses.
struct ZeroCase {
  std::string name;
  Opt opt = Opt::AdamW;
  int micro_batches = 1;
  bool overlap = false;
  bool bf16 = false;
  bool offload = false;  // the side stepping in backward offloads (ZeroOptions::cpu_offload)
};

optim::InnerOptimizerFactory inner_factory(Opt opt) {
  namespace zo = fsdp::optim;
  switch (opt) {
    case Opt::SGD: return zo::inner_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.05));
    case Opt::Adam: return zo::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-2));
    case Opt::AdamW: return zo::inner_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2));
    case Opt::CPUAdam: return zo::inner_optimizer<zo::CPUAdam>(zo::CPUAdamOptions(1e-2).adamw_mode(true));
  }
  return nullptr;
}

void check_zero_equal_to_step_after_backward(comm::ProcessGroup& pg, const ZeroCase& c) {
  run_case("zero2/" + c.name, [&] {
    struct Run {
      torch::nn::Sequential net{nullptr};
      std::unique_ptr<optim::ZeroRedundancyOptimizer> opt;
      std::unique_ptr<torch::optim::StepLR> sched;
    };
    auto make = [&](bool inside) {
      Run r;
      r.net = make_mlp();
      // Used on no rank: skipped by both (AdamW's decay would move it, and its state would exist).
      r.net->register_parameter("unused", torch::randn({7}));
      // The groups (weights, biases) with the options make_optimizer gives them.
      auto groups_of = make_optimizer(c.opt, *r.net);
      std::vector<torch::optim::OptimizerParamGroup> groups;
      for (auto& g : groups_of->param_groups()) groups.emplace_back(g.params(), g.options().clone());
      auto options = optim::ZeroOptions().process_group(pg).stage(2).reduce_bucket_size(300).module(r.net.ptr())
                         .overlap_communication(c.overlap).optimizer_in_backward(inside)
                         .cpu_offload(inside && c.offload);
      if (c.bf16) options.param_dtype(torch::kBFloat16);
      r.opt = std::make_unique<optim::ZeroRedundancyOptimizer>(std::move(groups), inner_factory(c.opt), options);
      r.sched = std::make_unique<torch::optim::StepLR>(*r.opt, 1, 0.8);
      return r;
    };
    Run ref = make(false), in = make(true);
    auto run_step = [&](Run& r, bool inside, int step) {
      r.opt->zero_grad(/*set_to_none=*/true);
      for (int k = 0; k < c.micro_batches; ++k) {
        std::optional<optim::ZeroRedundancyOptimizer::NoStepGuard> no_step;
        if (inside && k + 1 < c.micro_batches) no_step.emplace(r.opt->no_step());
        auto [x, y] = global_batch(step * c.micro_batches + k, 12);
        auto in_x = rank_slice(x, pg.rank(), pg.size());
        auto out = r.net->forward(c.bf16 ? in_x.to(torch::kBFloat16) : in_x).to(torch::kFloat);
        (torch::mse_loss(out, rank_slice(y, pg.rank(), pg.size())) / double(c.micro_batches)).backward();
      }
      r.opt->step();
      r.sched->step();
    };
    for (int s = 0; s < 4; ++s) {
      run_step(ref, false, s);
      run_step(in, true, s);
      expect_same_params(*in.net, *ref.net, "step " + std::to_string(s));
    }
    expect_same_state(in.opt->inner(), ref.opt->inner(), c.name);
  });
}

void zero_cases(comm::ProcessGroup& pg) {
  check_zero_equal_to_step_after_backward(pg, {"adamw", Opt::AdamW});
  check_zero_equal_to_step_after_backward(pg, {"sgd/overlap", Opt::SGD, 1, true});
  check_zero_equal_to_step_after_backward(pg, {"cpu_adam/no_step x3", Opt::CPUAdam, 3});
  check_zero_equal_to_step_after_backward(pg, {"adam/bf16/overlap", Opt::Adam, 1, true, true});
  check_zero_equal_to_step_after_backward(pg, {"cpu_adam/bf16/offload/no_step x2", Opt::CPUAdam, 2, false, true, true});
}

// Gradient memory, counted by the allocator: eight 256x256 units under FULL_SHARD, tiny
// activations. Stepping after backward ends backward holding every unit's gradient
// shard; stepping inside it frees each unit's as it is stepped.
void memory_cases(comm::ProcessGroup& pg) {
  auto* counter = install_counting_allocator();
  const int n = pg.size();
  constexpr int kUnits = 8;
  const int64_t unit_numel = 256 * 256 + 256;
  const int64_t chunk = (unit_numel + n - 1) / n;
  const int64_t unit_flat_bytes = 4 * n * chunk;       // one unit's flat gradient
  const int64_t model_shard_bytes = kUnits * 4 * chunk;  // the whole model's gradient shards (with padding)
  run_case("gradient peak", [&] {
    struct Measured {
      int64_t peak = 0;            // above the live bytes before the iteration
      int64_t after_backward = 0;  // held when backward returns, above the same
    };
    auto measure = [&](bool in_backward) {
      torch::manual_seed(0);
      torch::nn::Sequential net;
      for (int i = 0; i < kUnits; ++i) net->push_back(torch::nn::Linear(256, 256));
      auto m = FullyShardedDataParallel(net, pg, Options().auto_wrap_policy(always_wrap_policy()).optimizer_in_backward(in_backward));
      torch::optim::SGD o(m->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      if (in_backward) m->register_optimizer_in_backward(o);
      auto x = torch::randn({4, 256});
      Measured r;
      for (int step = 0; step < 4; ++step) {
        o.zero_grad(/*set_to_none=*/true);
        // Gloo's threads drop finished buffers shortly after wait() returns (test_fsdp_memory).
        comm::barrier(pg);
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        const int64_t before = counter->live();
        counter->reset_peak();
        m->forward(x).square().mean().backward();
        r.after_backward = counter->live() - before;
        o.step();
        r.peak = counter->peak() - before;  // the last (warm) step's
      }
      return r;
    };
    const Measured after = measure(false), inside = measure(true);
    std::printf("rank %d, %d ranks: peak above the model state %lld B stepping after backward, %lld B inside it; "
                "held after backward %lld B vs %lld B; one unit's flat gradient %lld B, the model's gradient "
                "shards %lld B\n",
                pg.rank(), n, (long long)after.peak, (long long)inside.peak, (long long)after.after_backward,
                (long long)inside.after_backward, (long long)unit_flat_bytes, (long long)model_shard_bytes);
    // After backward: every gradient shard (the padding aside) against none.
    EXPECT_GE(after.after_backward, model_shard_bytes - kUnits * 4 * n);
    EXPECT_LE(inside.after_backward, unit_flat_bytes / 8);
    // At the peak: the whole model's shards are gone, at most two units' flat gradients remain.
    EXPECT_LE(inside.peak, after.peak - model_shard_bytes + 2 * unit_flat_bytes);
  });
}

// A layer whose backward sleeps, so that the reductions of the units after it land while
// it runs.
struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*, torch::autograd::tensor_list g) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return g;
  }
};

torch::nn::Sequential make_slow_mlp() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(13, 32),
                               torch::nn::Functional([](const at::Tensor& x) { return SlowBackward::apply(x); }),
                               torch::nn::Linear(32, 32), torch::nn::ReLU(), torch::nn::Linear(32, 17),
                               torch::nn::ReLU(), torch::nn::Linear(17, 5));
}

// Under HYBRID_SHARD over Gloo a unit steps as its replica all-reduce lands, while backward
// still runs: every unit but the first layer has stepped before that layer's backward
// begins (the sleep lies between them). And the result is still that of stepping after
// backward.
void hybrid_arrival_cases(comm::ProcessGroup& pg) {
  const Options hybrid_units = hybrid(pg.size()).auto_wrap_policy(always_wrap_policy());
  check_equal_to_step_after_backward(pg, {"slow mlp/hybrid_shard/adam over gloo", hybrid_units, Opt::Adam, Accumulate::None, 1, 2},
                                     make_slow_mlp, [](int64_t s) { return global_batch(s, 12); });
  run_case("units step as their replica all-reduces land", [&] {
    auto model = FullyShardedDataParallel(make_slow_mlp(), pg, Options(hybrid_units).optimizer_in_backward(true));
    torch::optim::Adam opt(model->parameters(), 0.01);
    model->register_optimizer_in_backward(opt);
    std::vector<std::pair<std::string, std::string>> events;
    model->set_unit_boundary_observer([&](const std::string& unit, const char* phase) { events.emplace_back(unit, phase); });
    auto [x, y] = global_batch(0, 12);
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())).backward();
    model->set_unit_boundary_observer(nullptr);
    // The first layer is the last unit whose backward begins.
    std::string first_layer;
    size_t its_pre_backward = 0;
    for (size_t i = 0; i < events.size(); ++i)
      if (events[i].second == std::string("pre_backward")) std::tie(its_pre_backward, first_layer) = std::make_pair(i, events[i].first);
    std::set<std::string> stepped, stepped_before;
    long steps = 0;
    for (size_t i = 0; i < events.size(); ++i) {
      if (events[i].second != std::string("stepped")) continue;
      ++steps;
      stepped.insert(events[i].first);
      if (i < its_pre_backward) stepped_before.insert(events[i].first);
    }
    ASSERT_EQ(stepped.size(), 4u) << "a unit per Linear steps";
    EXPECT_EQ(steps, 4) << "each unit steps once";
    ASSERT_EQ(stepped.count(first_layer), 1u) << "the last unit to begin backward is a Linear: " << first_layer;
    stepped.erase(first_layer);
    EXPECT_EQ(stepped_before, stepped) << "every other unit stepped before the first layer's backward began";
  });
}

}  // namespace

TEST(OptimizerInBackward, HybridStepsAsReplicaAllReducesLand) {
  RankOptions o;
  o.extra_env = {"FSDP_SHARED_MEMORY=0"};  // the replica group on Gloo, whose completion can be asked
  run_ranks(4, hybrid_arrival_cases, o);
}

TEST(OptimizerInBackward, LifecycleArrows) {
  using fsdp::core::detail::UnitState;
  using fsdp::core::detail::unit_transition_allowed;
  EXPECT_TRUE(unit_transition_allowed(UnitState::kReduced, UnitState::kStepped));
  EXPECT_TRUE(unit_transition_allowed(UnitState::kStepped, UnitState::kIdle));
  for (auto from : {UnitState::kIdle, UnitState::kForward, UnitState::kAwaitBackward, UnitState::kBackward,
                    UnitState::kReducing, UnitState::kAccumulated, UnitState::kStepped})
    EXPECT_FALSE(unit_transition_allowed(from, UnitState::kStepped)) << fsdp::core::detail::to_string(from);
  EXPECT_FALSE(unit_transition_allowed(UnitState::kStepped, UnitState::kReduced));
}

TEST(OptimizerInBackward, BitwiseEqualToSteppingAfterBackward1To4Ranks) {
  for (int n = 1; n <= 4; ++n) run_ranks(n, equality_cases);
}

TEST(OptimizerInBackward, RefusalsAndNoSync) { run_ranks(2, refusal_cases); }

TEST(OptimizerInBackward, Zero2BitwiseEqualToSteppingInStep1To4Ranks) {
  for (int n = 1; n <= 4; ++n) run_ranks(n, zero_cases);
}

TEST(OptimizerInBackward, GradientMemoryIsOneUnitInFlight) {
  for (int n : {1, 2}) run_ranks(n, memory_cases);
}
