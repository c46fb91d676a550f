// fsdp::optim::CPUAdam against libtorch's own torch::optim::Adam / AdamW.
//
// Every comparison runs the two optimizers in lock step on copies of the same
// parameters and feeds them the same random gradients, then compares parameters
// and state (step, exp_avg, exp_avg_sq, max_exp_avg_sq) by relative L2 difference.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/optim/cpu_adam.h"
#include "fsdp/optim/group_options.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
// White-box: the SIMD target list and the target override for the per-target test.
#include "optim/kernels/adam_kernel.h"

namespace {

using fsdp::optim::CPUAdam;
using fsdp::optim::CPUAdamOptions;
using torch::optim::Optimizer;

constexpr double kTol = 1e-6;

// Shapes whose sizes are and are not multiples of every vector width (4..16 lanes).
const std::vector<std::vector<int64_t>> kShapes = {{1},       {7},      {16},        {1000},
                                                   {4099},    {3, 5, 7}, {64, 33},   {2, 3, 4, 5}};

double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const auto ad = a.to(torch::kFloat64);
  const auto bd = b.to(torch::kFloat64);
  const double denom = std::max(bd.norm().item<double>(), 1e-30);
  return (ad - bd).norm().item<double>() / denom;
}

std::vector<torch::Tensor> make_params(const std::vector<std::vector<int64_t>>& shapes,
                                       uint64_t seed,
                                       torch::Dtype dtype = torch::kFloat32) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> ps;
  for (const auto& s : shapes) ps.push_back(torch::randn(s, dtype).requires_grad_(true));
  return ps;
}

std::vector<torch::Tensor> clone_params(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

std::vector<torch::Tensor> random_grads(const std::vector<torch::Tensor>& ps, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> gs;
  for (const auto& p : ps) gs.push_back(torch::randn(p.sizes(), p.scalar_type()));
  return gs;
}

void set_grads(const std::vector<torch::Tensor>& ps, const std::vector<torch::Tensor>& gs,
               c10::optional<torch::Dtype> dtype = c10::nullopt) {
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].mutable_grad() = dtype ? gs[i].to(*dtype) : gs[i].clone();
  }
}

// Reads the Adam state of `p` whatever the optimizer (AdamParamState or AdamWParamState).
struct Fields {
  int64_t step = 0;
  torch::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
};
Fields state_of(const Optimizer& opt, const torch::Tensor& p) {
  const auto& st = opt.state();
  auto it = st.find(p.unsafeGetTensorImpl());
  EXPECT_NE(it, st.end());
  if (it == st.end()) return {};
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) {
    return {s->step(), s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()};
  }
  auto* s = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get());
  EXPECT_NE(s, nullptr);
  return {s->step(), s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()};
}

// Parameters and state of `a` against the reference `b`.
void expect_close(const Optimizer& a, const std::vector<torch::Tensor>& pa, const Optimizer& b,
                  const std::vector<torch::Tensor>& pb, const std::string& what,
                  double tol = kTol) {
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    SCOPED_TRACE(what + ", parameter " + std::to_string(i) + " of numel " +
                 std::to_string(pa[i].numel()));
    EXPECT_LT(rel_diff(pa[i], pb[i]), tol);
    const Fields fa = state_of(a, pa[i]);
    const Fields fb = state_of(b, pb[i]);
    EXPECT_EQ(fa.step, fb.step);
    EXPECT_LT(rel_diff(fa.exp_avg, fb.exp_avg), tol);
    EXPECT_LT(rel_diff(fa.exp_avg_sq, fb.exp_avg_sq), tol);
    EXPECT_EQ(fa.max_exp_avg_sq.defined(), fb.max_exp_avg_sq.defined());
    if (fa.max_exp_avg_sq.defined() && fb.max_exp_avg_sq.defined()) {
      EXPECT_LT(rel_diff(fa.max_exp_avg_sq, fb.max_exp_avg_sq), tol);
    }
  }
}

void expect_identical(const Optimizer& a, const std::vector<torch::Tensor>& pa,
                      const Optimizer& b, const std::vector<torch::Tensor>& pb) {
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
    const Fields fa = state_of(a, pa[i]);
    const Fields fb = state_of(b, pb[i]);
    EXPECT_EQ(fa.step, fb.step);
    EXPECT_TRUE(torch::equal(fa.exp_avg, fb.exp_avg)) << "exp_avg " << i;
    EXPECT_TRUE(torch::equal(fa.exp_avg_sq, fb.exp_avg_sq)) << "exp_avg_sq " << i;
  }
}

struct Config {
  bool adamw;
  double weight_decay;
  bool amsgrad;
  bool fused;
  std::string name() const {
    return std::string(adamw ? "AdamW" : "Adam") + " wd=" + std::to_string(weight_decay) +
           (amsgrad ? " amsgrad" : "") + (fused ? " fused" : " tensor-ops");
  }
};

std::unique_ptr<Optimizer> make_reference(const std::vector<torch::Tensor>& ps,
                                          const Config& c, double lr) {
  if (c.adamw) {
    return std::make_unique<torch::optim::AdamW>(
        ps, torch::optim::AdamWOptions(lr).weight_decay(c.weight_decay).amsgrad(c.amsgrad));
  }
  return std::make_unique<torch::optim::Adam>(
      ps, torch::optim::AdamOptions(lr).weight_decay(c.weight_decay).amsgrad(c.amsgrad));
}

CPUAdamOptions cpu_options(const Config& c, double lr) {
  return CPUAdamOptions(lr)
      .weight_decay(c.weight_decay)
      .amsgrad(c.amsgrad)
      .adamw_mode(c.adamw)
      .fused(c.fused);
}

// Steps `a` and `b` together `steps` times on the same random gradients.
void run_lockstep(Optimizer& a, const std::vector<torch::Tensor>& pa, Optimizer& b,
                  const std::vector<torch::Tensor>& pb, int steps, uint64_t seed) {
  for (int s = 0; s < steps; ++s) {
    const auto gs = random_grads(pa, seed + s);
    set_grads(pa, gs);
    set_grads(pb, gs);
    a.step();
    b.step();
  }
}

std::vector<Config> all_configs() {
  std::vector<Config> cs;
  for (bool adamw : {false, true})
    for (double wd : {0.0, 0.05})
      for (bool ams : {false, true})
        for (bool fused : {true, false}) cs.push_back({adamw, wd, ams, fused});
  return cs;
}

// ---------------------------------------------------------------------------

TEST(CPUAdam, MatchesTorchAdamAndAdamW100Steps) {
  for (const Config& c : all_configs()) {
    SCOPED_TRACE(c.name());
    auto pa = make_params(kShapes, 1);
    auto pb = clone_params(pa);
    CPUAdam ours(pa, cpu_options(c, 1e-2));
    auto ref = make_reference(pb, c, 1e-2);
    run_lockstep(ours, pa, *ref, pb, 100, 1000);
    expect_close(ours, pa, *ref, pb, c.name());
  }
}

TEST(CPUAdam, SeveralParamGroupsWithDifferentOptions) {
  for (bool adamw : {false, true}) {
    for (bool fused : {true, false}) {
      SCOPED_TRACE(std::string(adamw ? "AdamW" : "Adam") + (fused ? " fused" : " tensor-ops"));
      auto pa = make_params(kShapes, 2);
      auto pb = clone_params(pa);
      auto split = [](const std::vector<torch::Tensor>& ps, size_t lo, size_t hi) {
        return std::vector<torch::Tensor>(ps.begin() + lo, ps.begin() + hi);
      };
      std::vector<torch::optim::OptimizerParamGroup> ga, gb;
      ga.emplace_back(split(pa, 0, 3), std::make_unique<CPUAdamOptions>(
                                           CPUAdamOptions(1e-2).amsgrad(true).adamw_mode(adamw)
                                               .fused(fused)));
      ga.emplace_back(split(pa, 3, 6),
                      std::make_unique<CPUAdamOptions>(CPUAdamOptions(3e-3)
                                                           .weight_decay(0.1)
                                                           .betas({0.8, 0.99})
                                                           .eps(1e-6)
                                                           .adamw_mode(adamw)
                                                           .fused(fused)));
      ga.emplace_back(split(pa, 6, pa.size()));  // group defaults
      std::unique_ptr<Optimizer> ref;
      if (adamw) {
        std::vector<torch::optim::OptimizerParamGroup> g;
        g.emplace_back(split(pb, 0, 3), std::make_unique<torch::optim::AdamWOptions>(
                                            torch::optim::AdamWOptions(1e-2).amsgrad(true)
                                                .weight_decay(0)));
        g.emplace_back(split(pb, 3, 6), std::make_unique<torch::optim::AdamWOptions>(
                                            torch::optim::AdamWOptions(3e-3)
                                                .weight_decay(0.1)
                                                .betas({0.8, 0.99})
                                                .eps(1e-6)));
        g.emplace_back(split(pb, 6, pb.size()));
        ref = std::make_unique<torch::optim::AdamW>(
            g, torch::optim::AdamWOptions(2e-3).weight_decay(0.02));
        fsdp::optim::keep_group_options(*ref, g);  // the reference as the groups say, on every 2.x
      } else {
        std::vector<torch::optim::OptimizerParamGroup> g;
        g.emplace_back(split(pb, 0, 3), std::make_unique<torch::optim::AdamOptions>(
                                            torch::optim::AdamOptions(1e-2).amsgrad(true)));
        g.emplace_back(split(pb, 3, 6), std::make_unique<torch::optim::AdamOptions>(
                                            torch::optim::AdamOptions(3e-3)
                                                .weight_decay(0.1)
                                                .betas({0.8, 0.99})
                                                .eps(1e-6)));
        g.emplace_back(split(pb, 6, pb.size()));
        ref = std::make_unique<torch::optim::Adam>(
            g, torch::optim::AdamOptions(2e-3).weight_decay(0.02));
        fsdp::optim::keep_group_options(*ref, g);
      }
      CPUAdam ours(std::move(ga),
                   CPUAdamOptions(2e-3).weight_decay(0.02).adamw_mode(adamw).fused(fused));
      run_lockstep(ours, pa, *ref, pb, 100, 2000);
      expect_close(ours, pa, *ref, pb, "groups");
    }
  }
}

// A parameter group's own options survive construction on every libtorch 2.x: newer
// releases' add_param_group replaces options of types it does not know (CPUAdamOptions) by
// the defaults, and takes a known type's value equal to that type's own default (AdamW's
// weight_decay 1e-2, lr 1e-3) as unset.
TEST(ParamGroups, OwnOptionsSurviveConstruction) {
  auto a = torch::zeros({3}, torch::requires_grad());
  auto b = torch::zeros({2}, torch::requires_grad());
  {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{a},
                        std::make_unique<CPUAdamOptions>(CPUAdamOptions(0.5).weight_decay(0.25)));
    groups.emplace_back(std::vector<torch::Tensor>{b});
    CPUAdam opt(groups, CPUAdamOptions(1e-3).weight_decay(0.01));
    const auto& own = static_cast<const CPUAdamOptions&>(opt.param_groups()[0].options());
    const auto& dflt = static_cast<const CPUAdamOptions&>(opt.param_groups()[1].options());
    EXPECT_EQ(own.lr(), 0.5);
    EXPECT_EQ(own.weight_decay(), 0.25);
    EXPECT_EQ(dflt.lr(), 1e-3);
    EXPECT_EQ(dflt.weight_decay(), 0.01);
  }
  {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{a}, std::make_unique<torch::optim::AdamWOptions>(
                                                           torch::optim::AdamWOptions(1e-3).weight_decay(1e-2)));
    groups.emplace_back(std::vector<torch::Tensor>{b});
    auto inner = fsdp::optim::inner_optimizer<torch::optim::AdamW>(
        torch::optim::AdamWOptions(0.1).weight_decay(0.5))(groups);
    const auto& own = static_cast<const torch::optim::AdamWOptions&>(inner->param_groups()[0].options());
    const auto& dflt = static_cast<const torch::optim::AdamWOptions&>(inner->param_groups()[1].options());
    EXPECT_EQ(own.lr(), 1e-3);
    EXPECT_EQ(own.weight_decay(), 1e-2);
    EXPECT_EQ(dflt.lr(), 0.1);
    EXPECT_EQ(dflt.weight_decay(), 0.5);
    // The same through the public helper, on an optimizer the user builds.
    torch::optim::AdamW plain(groups, torch::optim::AdamWOptions(0.1).weight_decay(0.5));
    fsdp::optim::keep_group_options(plain, groups);
    EXPECT_EQ(static_cast<const torch::optim::AdamWOptions&>(plain.param_groups()[0].options()).weight_decay(), 1e-2);
  }
}

TEST(CPUAdam, EverySimdTargetMatchesTorch) {
  namespace k = fsdp::optim::kernels;
  const auto targets = k::adam_kernel_supported_targets();
  ASSERT_FALSE(targets.empty());
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t n = 1; n <= 33; ++n) shapes.push_back({n});
  shapes.push_back({4099});
  for (int64_t target : targets) {
    k::adam_kernel_force_target(target);
    SCOPED_TRACE("target " + k::adam_kernel_target());
    for (const Config& c : {Config{false, 0.05, true, true}, Config{true, 0.05, false, true}}) {
      auto pa = make_params(shapes, 3);
      auto pb = clone_params(pa);
      CPUAdam ours(pa, cpu_options(c, 1e-2));
      auto ref = make_reference(pb, c, 1e-2);
      run_lockstep(ours, pa, *ref, pb, 20, 3000);
      expect_close(ours, pa, *ref, pb, c.name());
    }
    // Low-precision gradients and copy-outs on this target.
    for (auto low : {torch::kBFloat16, torch::kFloat16}) {
      auto pa = make_params(shapes, 4);
      auto pb = clone_params(pa);
      CPUAdam a(pa, CPUAdamOptions(1e-2));
      CPUAdam b(pb, CPUAdamOptions(1e-2));
      std::vector<torch::Tensor> outs;
      for (const auto& p : pa) {
        outs.push_back(torch::empty(p.sizes(), low));
        a.set_copy_out(p, outs.back());
      }
      for (int s = 0; s < 5; ++s) {
        const auto gs = random_grads(pa, 4000 + s);
        std::vector<torch::Tensor> low_gs;
        for (const auto& g : gs) low_gs.push_back(g.to(low));
        set_grads(pa, low_gs);
        set_grads(pb, low_gs, torch::kFloat32);
        a.step();
        b.step();
      }
      for (size_t i = 0; i < pa.size(); ++i) {
        EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "numel " << pa[i].numel();
        EXPECT_TRUE(torch::equal(outs[i], pa[i].detach().to(low))) << "numel " << pa[i].numel();
      }
    }
  }
  k::adam_kernel_force_target(0);
}

TEST(CPUAdam, CopyOutEqualsRoundedMaster) {
  for (auto low : {torch::kBFloat16, torch::kFloat16}) {
    for (bool fused : {true, false}) {
      SCOPED_TRACE(std::string(c10::toString(low)) + (fused ? " fused" : " tensor-ops"));
      auto ps = make_params(kShapes, 5);
      CPUAdam opt(ps, CPUAdamOptions(1e-2).weight_decay(0.01).adamw_mode(true).fused(fused));
      std::vector<torch::Tensor> outs;
      for (const auto& p : ps) {
        // A flat output of the parameter's numel is accepted.
        outs.push_back(torch::empty({p.numel()}, low));
        opt.set_copy_out(p, outs.back());
        EXPECT_TRUE(torch::equal(outs.back(), p.detach().reshape({-1}).to(low)))
            << "filled at set_copy_out";
      }
      for (int s = 0; s < 100; ++s) {
        set_grads(ps, random_grads(ps, 5000 + s));
        opt.step();
        if (s % 25 == 24) {
          for (size_t i = 0; i < ps.size(); ++i) {
            EXPECT_TRUE(torch::equal(outs[i], ps[i].detach().reshape({-1}).to(low)))
                << "step " << s << ", parameter " << i;
          }
        }
      }
      EXPECT_TRUE(opt.copy_out(ps[0]).is_same(outs[0]));
      opt.clear_copy_out(ps[0]);
      EXPECT_FALSE(opt.copy_out(ps[0]).defined());
    }
  }
}

TEST(CPUAdam, CopyOutRoundsTiesAndExtremesLikeTorch) {
  // lr = 0 leaves the parameter unchanged, so the copy-out shows the rounding alone.
  const float f16_max = 65504.f;
  std::vector<float> values = {0.f,          -0.f,        1.f,        -1.f,
                               1.00390625f,  // 1 + 2^-8: bf16 tie, rounds down to even
                               1.01171875f,  // 1 + 3 * 2^-8: bf16 tie, rounds up to even
                               1.00048828125f,  // 1 + 2^-11: fp16 tie
                               1.00146484375f,  // 1 + 3 * 2^-11: fp16 tie
                               f16_max,      65519.f,     65520.f,    1e5f,
                               -1e5f,        1e-5f,       6e-8f,      2e-8f,
                               1e-40f,       3.3e38f,     3.4e38f,    -3.4e38f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity()};
  torch::manual_seed(6);
  auto random_part = torch::randn({1000}) * torch::exp(torch::randn({1000}) * 10);
  auto p = torch::cat({torch::tensor(values), random_part}).requires_grad_(true);
  for (auto low : {torch::kBFloat16, torch::kFloat16}) {
    for (bool fused : {true, false}) {
      SCOPED_TRACE(std::string(c10::toString(low)) + (fused ? " fused" : " tensor-ops"));
      auto q = p.detach().clone().requires_grad_(true);
      CPUAdam opt({q}, CPUAdamOptions(0.0).fused(fused));
      auto out = torch::zeros(q.sizes(), low);
      opt.set_copy_out(q, out);
      out.zero_();
      q.mutable_grad() = torch::ones_like(q);
      opt.step();
      EXPECT_TRUE(torch::equal(q.detach(), p.detach()));  // lr = 0: unchanged
      const auto expected = q.detach().to(low);
      EXPECT_TRUE(torch::equal(out, expected));
      if (!torch::equal(out, expected)) {
        const auto bad = (out.to(torch::kFloat32) != expected.to(torch::kFloat32)).nonzero();
        ADD_FAILURE() << "first mismatch at " << bad[0].item<int64_t>() << ": value "
                      << q[bad[0].item<int64_t>()].item<float>();
      }
    }
  }
}

TEST(CPUAdam, LowPrecisionGradsEqualTheirFp32Upcast) {
  for (auto low : {torch::kBFloat16, torch::kFloat16}) {
    for (bool fused : {true, false}) {
      SCOPED_TRACE(std::string(c10::toString(low)) + (fused ? " fused" : " tensor-ops"));
      auto pa = make_params(kShapes, 7);
      auto pb = clone_params(pa);
      auto pc = clone_params(pa);
      const auto opts = CPUAdamOptions(1e-2).weight_decay(0.01).amsgrad(true).fused(fused);
      CPUAdam a(pa, opts);
      CPUAdam b(pb, opts);
      torch::optim::Adam ref(pc, torch::optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(true));
      for (int s = 0; s < 50; ++s) {
        std::vector<torch::Tensor> low_gs;
        for (const auto& g : random_grads(pa, 7000 + s)) low_gs.push_back(g.to(low));
        set_grads(pa, low_gs);
        set_grads(pb, low_gs, torch::kFloat32);
        set_grads(pc, low_gs, torch::kFloat32);
        a.step();
        b.step();
        ref.step();
      }
      expect_identical(a, pa, b, pb);
      expect_close(a, pa, ref, pc, "vs torch Adam on upcast grads");
    }
  }
}

TEST(CPUAdam, MaximizeAscendsTheNegatedGradient) {
  for (bool fused : {true, false}) {
    auto pa = make_params(kShapes, 8);
    auto pb = clone_params(pa);
    CPUAdam a(pa, CPUAdamOptions(1e-2).weight_decay(0.01).maximize(true).fused(fused));
    torch::optim::Adam ref(pb, torch::optim::AdamOptions(1e-2).weight_decay(0.01));
    for (int s = 0; s < 30; ++s) {
      const auto gs = random_grads(pa, 8000 + s);
      std::vector<torch::Tensor> neg;
      for (const auto& g : gs) neg.push_back(-g);
      set_grads(pa, gs);
      set_grads(pb, neg);
      a.step();
      ref.step();
    }
    expect_close(a, pa, ref, pb, fused ? "maximize fused" : "maximize tensor-ops");
  }
}

TEST(CPUAdam, FallbackTakesDoubleParameters) {
  auto pa = make_params(kShapes, 9, torch::kFloat64);
  auto pb = clone_params(pa);
  CPUAdam a(pa, CPUAdamOptions(1e-2).weight_decay(0.01).amsgrad(true).fused(false));
  torch::optim::Adam ref(pb, torch::optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(true));
  run_lockstep(a, pa, ref, pb, 20, 9000);
  expect_close(a, pa, ref, pb, "fp64", 1e-14);
}

TEST(CPUAdam, ThreadCountDoesNotChangeTheResult) {
  const int saved = at::get_num_threads();
  const std::vector<std::vector<int64_t>> shapes = {{300001}, {1000}};
  std::vector<std::vector<torch::Tensor>> results;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    ASSERT_EQ(at::get_num_threads(), threads);
    auto pa = make_params(shapes, 10);
    auto pb = clone_params(pa);
    CPUAdam ours(pa, CPUAdamOptions(1e-2).weight_decay(0.01).amsgrad(true));
    torch::optim::Adam ref(pb, torch::optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(true));
    run_lockstep(ours, pa, ref, pb, 10, 10000);
    expect_close(ours, pa, ref, pb, "threads " + std::to_string(threads));
    results.push_back(pa);
  }
  at::set_num_threads(saved);
  for (size_t i = 0; i < results[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(results[0][i], results[1][i])) << "parameter " << i;
  }
}

// CPUAdam k steps -> torch optimizer m steps -> CPUAdam rest, against CPUAdam alone.
void check_round_trip(bool adamw, const std::function<void(const Optimizer&, Optimizer&)>& move) {
  const Config c{adamw, 0.05, true, true};
  auto straight = make_params(kShapes, 11);
  auto relay = clone_params(straight);
  CPUAdam reference(straight, cpu_options(c, 1e-2));

  auto first = std::make_unique<CPUAdam>(relay, cpu_options(c, 1e-2));
  auto middle = make_reference(relay, c, 1e-2);
  auto last = std::make_unique<CPUAdam>(relay, cpu_options(c, 1e-2));
  std::vector<Optimizer*> legs = {first.get(), middle.get(), last.get()};
  const int leg_steps[] = {30, 30, 40};
  int step = 0;
  for (size_t leg = 0; leg < legs.size(); ++leg) {
    if (leg > 0) move(*legs[leg - 1], *legs[leg]);
    for (int s = 0; s < leg_steps[leg]; ++s, ++step) {
      const auto gs = random_grads(straight, 11000 + step);
      set_grads(straight, gs);
      set_grads(relay, gs);
      reference.step();
      legs[leg]->step();
    }
  }
  expect_close(*last, relay, reference, straight, adamw ? "AdamW relay" : "Adam relay");
}

TEST(CPUAdam, StateRoundTripThroughTorchSaveLoad) {
  for (bool adamw : {false, true}) {
    check_round_trip(adamw, [](const Optimizer& from, Optimizer& to) {
      std::stringstream buffer;
      torch::serialize::OutputArchive out;
      from.save(out);
      out.save_to(buffer);
      torch::serialize::InputArchive in;
      in.load_from(buffer);
      to.load(in);
    });
  }
}

// Optimizer archives that libtorch 1.13's torch::save wrote (tests/fixtures/ckpt-1.13/optim,
// README there): their state keys are hex TensorImpl addresses, which libtorch 2.x's own
// loader reads as 0. CPUAdam loads them (its own and torch::optim::Adam's) onto the right
// parameters, and the next step gives what 1.13 gave.
TEST(CPUAdam, LoadsLibtorch113Archives) {
  const char* src = std::getenv("FSDP_SOURCE_DIR");
  if (src == nullptr) GTEST_SKIP() << "FSDP_SOURCE_DIR is not set (ctest sets it)";
  const std::string dir = std::string(src) + "/tests/fixtures/ckpt-1.13/optim/";
  torch::serialize::InputArchive expected;
  expected.load_from(dir + "optim_expected.pt");
  auto tensor = [&](const std::string& key) {
    torch::Tensor t;
    expected.read(key, t);
    return t;
  };
  for (const std::string which : {"cpu_adam", "adam"}) {
    SCOPED_TRACE(which + ".pt into CPUAdam");
    std::vector<torch::Tensor> params;
    for (int i = 0; i < 2; ++i)
      params.push_back(tensor(which + ".param" + std::to_string(i) + ".after3").clone().requires_grad_());
    CPUAdam opt(params, CPUAdamOptions(0.01));
    torch::load(opt, dir + which + ".pt");
    for (int i = 0; i < 2; ++i) {
      const auto& st = dynamic_cast<const torch::optim::AdamParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
      EXPECT_EQ(st.step(), 3);
      EXPECT_TRUE(st.exp_avg().equal(tensor(which + ".exp_avg" + std::to_string(i))));
      EXPECT_TRUE(st.exp_avg_sq().equal(tensor(which + ".exp_avg_sq" + std::to_string(i))));
      params[i].mutable_grad() = tensor(which + ".grad" + std::to_string(i) + ".step4");
    }
    opt.step();
    for (int i = 0; i < 2; ++i) {
      EXPECT_LT(rel_diff(params[i].detach(), tensor(which + ".param" + std::to_string(i) + ".after4")), 1e-6);
    }
  }
}

TEST(CPUAdam, StateRoundTripThroughCopyAdamState) {
  for (bool adamw : {false, true}) {
    check_round_trip(adamw, [](const Optimizer& from, Optimizer& to) {
      fsdp::optim::copy_adam_state(from, to);
    });
  }
}

TEST(CPUAdam, StateEntriesAreTorchAdamParamState) {
  // torch::optim::Adam and CPUAdam share the state class and key, so entries move
  // by plain copies.
  auto pa = make_params(kShapes, 12);
  auto pb = clone_params(pa);
  CPUAdam ours(pa, CPUAdamOptions(1e-2));
  torch::optim::Adam theirs(pb, torch::optim::AdamOptions(1e-2));
  run_lockstep(ours, pa, theirs, pb, 10, 12000);
  for (auto& p : pa) {
    const auto key = p.unsafeGetTensorImpl();
    ASSERT_NE(dynamic_cast<torch::optim::AdamParamState*>(ours.state().at(key).get()), nullptr);
  }
  for (size_t i = 0; i < pa.size(); ++i) {
    // OptimizerParamState::clone() shares the tensors: copy them too.
    const auto& src = static_cast<const torch::optim::AdamParamState&>(
        *ours.state().at(pa[i].unsafeGetTensorImpl()));
    auto copy = std::make_unique<torch::optim::AdamParamState>(src);
    copy->exp_avg(src.exp_avg().clone());
    copy->exp_avg_sq(src.exp_avg_sq().clone());
    theirs.state()[pb[i].unsafeGetTensorImpl()] = std::move(copy);
    pb[i].detach().copy_(pa[i].detach());
  }
  run_lockstep(ours, pa, theirs, pb, 10, 12100);
  expect_close(ours, pa, theirs, pb, "after copying state() entries");
}

TEST(CPUAdam, OptionsSerializeAndReadTorchAdamOptions) {
  auto round_trip = [](const torch::optim::OptimizerOptions& from,
                       torch::optim::OptimizerOptions& to) {
    torch::serialize::OutputArchive out;
    from.serialize(out);
    std::stringstream buffer;
    out.save_to(buffer);
    torch::serialize::InputArchive in;
    in.load_from(buffer);
    to.serialize(in);
  };
  const auto ours = CPUAdamOptions(0.25)
                        .betas({0.5, 0.75})
                        .eps(1e-3)
                        .weight_decay(0.125)
                        .amsgrad(true)
                        .adamw_mode(true)
                        .maximize(true)
                        .fused(false);
  CPUAdamOptions back(0);
  round_trip(ours, back);
  EXPECT_TRUE(back == ours);

  torch::optim::AdamOptions as_adam(0);
  round_trip(ours, as_adam);
  EXPECT_TRUE(as_adam == torch::optim::AdamOptions(0.25)
                             .betas({0.5, 0.75})
                             .eps(1e-3)
                             .weight_decay(0.125)
                             .amsgrad(true));

  CPUAdamOptions from_adam(0);
  round_trip(as_adam, from_adam);
  EXPECT_TRUE(from_adam == CPUAdamOptions(as_adam));
  EXPECT_FALSE(from_adam.adamw_mode());
  EXPECT_TRUE(from_adam.fused());
  EXPECT_EQ(from_adam.get_lr(), 0.25);
  from_adam.set_lr(0.5);
  EXPECT_EQ(from_adam.lr(), 0.5);
}

// ---------------------------------------------------------------------------
// Errors

template <typename F>
void expect_error(F&& f, const std::vector<std::string>& substrings) {
  try {
    f();
    ADD_FAILURE() << "expected a c10::Error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& s : substrings) {
      EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
    }
  }
}

TEST(CPUAdamErrors, InvalidHyperParametersPrintTheValue) {
  auto ps = make_params({{4}}, 13);
  expect_error([&] { CPUAdam o(ps, CPUAdamOptions(-1)); }, {"learning rate", "-1"});
  expect_error([&] { CPUAdam o(ps, CPUAdamOptions().betas({1.5, 0.999})); },
               {"beta parameter at index 0", "1.5"});
  expect_error([&] { CPUAdam o(ps, CPUAdamOptions().betas({0.9, -0.25})); },
               {"beta parameter at index 1", "-0.25"});
  expect_error([&] { CPUAdam o(ps, CPUAdamOptions().eps(-0.001)); }, {"epsilon", "-0.001"});
  expect_error([&] { CPUAdam o(ps, CPUAdamOptions().weight_decay(-0.5)); },
               {"weight_decay", "-0.5"});
  // A bad value set after construction is caught at the next step.
  CPUAdam opt(ps);
  opt.param_groups()[0].options().set_lr(-2);
  ps[0].mutable_grad() = torch::ones({4});
  expect_error([&] { opt.step(); }, {"learning rate", "-2", "param group 0"});
}

TEST(CPUAdamErrors, SparseGradient) {
  auto ps = make_params({{4}}, 14);
  for (bool fused : {true, false}) {
    CPUAdam opt(ps, CPUAdamOptions().fused(fused));
    ps[0].mutable_grad() = torch::ones({4}).to_sparse();
    expect_error([&] { opt.step(); }, {"sparse", "parameter 0 of param group 0"});
  }
}

TEST(CPUAdamErrors, UnsupportedDtypesAndLayouts) {
  {
    auto ps = make_params({{4}}, 15, torch::kFloat64);
    CPUAdam opt(ps);
    ps[0].mutable_grad() = torch::ones({4}, torch::kFloat64);
    expect_error([&] { opt.step(); }, {"fp32 parameters", "Double", "fused(false)"});
  }
  {
    auto ps = make_params({{4}}, 16);
    CPUAdam opt(ps);
    ps[0].mutable_grad() = torch::ones({4}, torch::kFloat64);
    expect_error([&] { opt.step(); }, {"gradient dtype", "Double"});
  }
  {
    auto ps = make_params({{4}}, 17);
    CPUAdam opt(ps, CPUAdamOptions().fused(false));
    ps[0].mutable_grad() = torch::ones({4}, torch::kInt32);
    expect_error([&] { opt.step(); }, {"gradient dtype", "Int"});
  }
  {
    auto p = torch::randn({8, 4}).t().requires_grad_(true);
    CPUAdam opt({p});
    p.mutable_grad() = torch::ones({4, 8});
    expect_error([&] { opt.step(); }, {"contiguous", "[4, 8]"});
    // The tensor-op path takes it.
    CPUAdam fallback({p}, CPUAdamOptions().fused(false));
    EXPECT_NO_THROW(fallback.step());
  }
  {
    auto ps = make_params({{4}}, 18);
    CPUAdam opt(ps);
    expect_error([&] { opt.set_copy_out(ps[0], torch::empty({4})); }, {"bf16 or fp16", "Float"});
    expect_error([&] { opt.set_copy_out(ps[0], torch::empty({5}, torch::kBFloat16)); },
                 {"numel (4)"});
    expect_error([&] { opt.set_copy_out(torch::randn({4}), torch::empty({4}, torch::kBFloat16)); },
                 {"not a parameter of this optimizer"});
  }
  {
    auto ps = make_params({{4}}, 19);
    CPUAdam opt(ps);
    opt.state()[ps[0].unsafeGetTensorImpl()] =
        std::make_unique<torch::optim::AdamWParamState>();
    ps[0].mutable_grad() = torch::ones({4});
    expect_error([&] { opt.step(); }, {"AdamParamState", "copy_adam_state"});
  }
}

}  // namespace
