// The remaining FSDP options against independent references: sync_module_states,
// ignored_modules (replicated, never reduced, counted once by clip_grad_norm_),
// gradient_predivide_factor, and a user-supplied reduce_group.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/core/call.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

template <typename Fn>
void expect_error(Fn fn, const std::string& needle, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(needle), std::string::npos) << what << ": '" << needle << "' not in: " << msg;
  }
}

// A model whose forward calls the entries of a ModuleList and a ModuleDict through
// fsdp::call (fsdp/core/call.h); `direct` calls the list's entries directly instead.
struct ListNetImpl : torch::nn::Module {
  explicit ListNetImpl(bool direct = false) : direct(direct) {
    torch::manual_seed(0);
    blocks->push_back(torch::nn::Linear(13, 32));
    blocks->push_back(torch::nn::Linear(32, 17));
    heads->update(torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>(
        {{"out", torch::nn::Linear(17, 5).ptr()}}));
    register_module("blocks", blocks);
    register_module("heads", heads);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < blocks->size(); ++i)
      x = torch::relu(direct ? blocks[i]->as<torch::nn::LinearImpl>()->forward(x)
                             : fsdp::call<torch::nn::LinearImpl>(blocks, i, x));
    return fsdp::call<torch::nn::LinearImpl>(heads, "out", x);
  }
  torch::nn::ModuleList blocks;
  torch::nn::ModuleDict heads;
  bool direct;
};
TORCH_MODULE(ListNet);

// SGD (plain) for `steps` steps on the global batch: reference parameters.
std::map<std::string, torch::Tensor> reference_sgd(int steps, double lr = 0.1) {
  auto ref = make_mlp(0);
  torch::optim::SGD opt(ref->parameters(), lr);
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(s, 12);
    opt.zero_grad(/*set_to_none=*/false);
    torch::mse_loss(ref->forward(x), y).backward();
    opt.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : ref->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

template <typename Impl>
void train_sgd(FullyShardedDataParallel<Impl>& model, comm::ProcessGroup& pg, int steps, double lr = 0.1) {
  torch::optim::SGD opt(model->parameters(), lr);
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(s, 12);
    opt.zero_grad(/*set_to_none=*/false);
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()))
        .backward();
    opt.step();
  }
}

void expect_matches(const std::map<std::string, torch::Tensor>& got,
                    const std::map<std::string, torch::Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name;
    EXPECT_LT(rel_diff(got.at(name), w), 1e-5) << what << ": " << name;
  }
}

// A module with a parameter on the CPU and one on `second` (the meta device: this machine
// has no GPU, and placement refuses every device but CPU and CUDA alike).
struct TwoDevicesImpl : torch::nn::Module {
  TwoDevicesImpl(bool first_on_cpu, torch::Device second) {
    a = register_parameter("a", torch::ones({4}, first_on_cpu ? torch::Device(torch::kCPU) : second));
    b = register_parameter("b", torch::ones({4}, second));
  }
  torch::Tensor forward(torch::Tensor x) { return x * a * b; }
  torch::Tensor a, b;
};
TORCH_MODULE(TwoDevices);

// [Note: device placement]: one device per model, checked before any group is made, for
// FSDP and ZeRO alike (the CUDA cases are tests/test_fsdp_cuda.cpp's, on a GPU machine).
void device_cases(comm::ProcessGroup& pg) {
  run_case("a model on two devices, or on a device neither CPU nor CUDA, is refused by name", [&] {
    const torch::Device meta(torch::kMeta);
    expect_error([&] { FullyShardedDataParallel(TwoDevices(true, meta), pg); },
                 "fsdp (rank " + std::to_string(pg.rank()) + "): the model's parameters are on more than one "
                 "device: 'a' on cpu, 'b' on meta", "two devices");
    expect_error([&] { FullyShardedDataParallel(TwoDevices(false, meta), pg); },
                 "parameter 'a' is on meta; FSDP and ZeRO run on CPU and CUDA devices only", "meta");
    auto zero_of = [&](TwoDevices m) {
      optim::ZeroRedundancyOptimizer(m->parameters(),
                                     optim::inner_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
                                     optim::ZeroOptions().process_group(pg));
    };
    expect_error([&] { zero_of(TwoDevices(true, meta)); },
                 "ZeroRedundancyOptimizer (rank " + std::to_string(pg.rank()) + "): trainable parameter "
                 "param_groups[0][0] is Float on cpu but param_groups[0][1] is Float on meta", "ZeRO, two devices");
    expect_error([&] { zero_of(TwoDevices(false, meta)); },
                 "] is on meta; FSDP and ZeRO run on CPU and CUDA devices only", "ZeRO, meta");
  });
}

void option_cases(comm::ProcessGroup& pg) {
  const int n = pg.size();
  const auto want = reference_sgd(4);

  run_case("sync_module_states", [&] {
    // Every rank starts from different weights; rank 0's win.
    auto model = FullyShardedDataParallel(make_mlp(/*seed=*/100 + pg.rank()), pg,
                                          Options().sync_module_states(true).auto_wrap_policy(always_wrap_policy()));
    auto initial = full_params(model);
    auto rank0 = make_mlp(100);
    for (const auto& p : rank0->named_parameters())
      EXPECT_TRUE(torch::equal(initial.at(p.key()), p.value())) << p.key();
    // Same check with the reference's seed: training then matches it.
    auto synced = FullyShardedDataParallel(make_mlp(pg.rank() == 0 ? 0 : 7), pg,
                                           Options().sync_module_states(true).auto_wrap_policy(always_wrap_policy()));
    train_sgd(synced, pg, 4);
    expect_matches(full_params(synced), want, "after sync_module_states");
  });

  for (double factor : {1.0, double(n)}) {
    run_case("gradient_predivide_factor " + std::to_string(factor), [&] {
      auto model = FullyShardedDataParallel(
          make_mlp(0), pg, Options().gradient_predivide_factor(factor).auto_wrap_policy(always_wrap_policy()));
      train_sgd(model, pg, 4);
      expect_matches(full_params(model), want, "predivide");
    });
  }
  run_case("gradient_predivide_factor out of range", [&] {
    expect_error([&] { FullyShardedDataParallel(make_mlp(0), pg, Options().gradient_predivide_factor(0.5)); },
                 "gradient_predivide_factor", "0.5");
    expect_error([&] { FullyShardedDataParallel(make_mlp(0), pg, Options().gradient_predivide_factor(n + 1.0)); },
                 "gradient_predivide_factor", "n+1");
  });

  run_case("reduce_group", [&] {
    std::vector<int> all(n);
    for (int r = 0; r < n; ++r) all[r] = r;
    auto reduce = pg.new_subgroup(all);
    comm::comm_counters().reset();
    auto model = FullyShardedDataParallel(make_mlp(0), pg,
                                          Options().reduce_group(reduce).auto_wrap_policy(always_wrap_policy()));
    train_sgd(model, pg, 4);
    expect_matches(full_params(model), want, "custom reduce group");
    if (n > 1) {
      EXPECT_GT(comm::comm_counters().reduce_scatter.load(), 0);
      // A group of another size is refused with both sizes.
      auto smaller = pg.new_subgroup({0});
      if (pg.rank() == 0) {
        expect_error([&] { FullyShardedDataParallel(make_mlp(0), pg, Options().reduce_group(smaller)); },
                     "reduce_group has 1 ranks", "small reduce group");
      }
      comm::barrier(pg);
    }
  });

  run_case("ignored_modules", [&] {
    // Layer "4" is ignored: replicated at full shape, never reduced (its
    // gradient is this rank's own), counted once by clip_grad_norm_.
    auto inner = make_mlp(0);
    auto ignored = inner[4];
    auto model = FullyShardedDataParallel(inner, pg,
                                          Options().ignored_modules({ignored}).auto_wrap_policy(always_wrap_policy()));
    EXPECT_EQ(model->unit_paths(), (std::vector<std::string>{"0", "2"}));
    auto [x, y] = global_batch(0, 12);
    auto xs = rank_slice(x, pg.rank(), n), ys = rank_slice(y, pg.rank(), n);
    torch::mse_loss(model->forward(xs), ys).backward();

    // References: global-batch gradients for managed parameters, the local
    // slice's gradients for the ignored ones.
    auto global_ref = make_mlp(0);
    torch::mse_loss(global_ref->forward(x), y).backward();
    auto local_ref = make_mlp(0);
    torch::mse_loss(local_ref->forward(xs), ys).backward();
    auto gp = global_ref->named_parameters();
    auto lp = local_ref->named_parameters();
    double managed_sq = 0, ignored_sq = 0;
    for (const auto& p : model->named_parameters()) {
      const bool is_ignored = p.key().rfind("4.", 0) == 0;
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      if (is_ignored) {
        EXPECT_EQ(p.value().sizes(), lp[p.key()].sizes()) << "ignored parameters keep their shape";
        EXPECT_LT(rel_diff(p.value().grad(), lp[p.key()].grad()), 1e-6) << p.key();
        ignored_sq += p.value().grad().square().sum().item<double>();
      } else {
        managed_sq += gp[p.key()].grad().square().sum().item<double>();
      }
    }
    // Each rank: global managed norm (reduced) plus its own ignored part, once.
    auto total = model->clip_grad_norm_(1e9, 2.0);
    EXPECT_NEAR(total.item<double>(), std::sqrt(managed_sq + ignored_sq), 1e-5 * std::sqrt(managed_sq + ignored_sq));
  });
  run_case("path_policy", [&] {
    auto wrap = [&](std::vector<std::string> paths) {
      return FullyShardedDataParallel(make_transformer(0), pg, Options().auto_wrap_policy(path_policy(paths)));
    };
    // Paths and patterns choose among the wrap candidates: the Wrappable blocks and the
    // entries of each block's mlp Sequential (the GELU, without parameters, makes no unit; the
    // root "" keeps proj and head).
    EXPECT_EQ(wrap({"block*"})->unit_paths(), (std::vector<std::string>{"", "block0", "block1"}));
    EXPECT_EQ(wrap({"block0.mlp.*", "block1"})->unit_paths(),
              (std::vector<std::string>{"", "block0.mlp.0", "block0.mlp.2", "block1"}));
    // A plain member (head: a Linear held by the model's own class) cannot be a unit: refused,
    // naming it, its type and the change that makes it a candidate; so is a path naming nothing.
    expect_error([&] { wrap({"head"}); }, "path_policy names 'head' (torch::nn::LinearImpl), which cannot become a unit",
                 "non-candidate path");
    expect_error([&] { wrap({"head"}); }, "fsdp::Wrappable<torch::nn::LinearImpl>", "the fix");
    expect_error([&] { wrap({"blocks.*"}); }, "path_policy names 'blocks.*', which matches no module",
                 "a path naming nothing");
  });
  run_case("frozen_after_wrapping", [&] {
    // Trainable and frozen parameters are laid out apart at wrapping ([Note: frozen
    // companions]): changing requires_grad afterwards is refused by name.
    auto model = FullyShardedDataParallel(make_mlp(0), pg, Options().auto_wrap_policy(always_wrap_policy()));
    for (auto& p : model->named_parameters())
      if (p.key() == "2.weight") p.value().requires_grad_(false);
    auto [x, y] = global_batch(0, 12);
    expect_error([&] { model->forward(rank_slice(x, pg.rank(), n)); },
                 "parameter '2.weight' (unit '2') was frozen after the model was wrapped", "frozen after wrapping");
  });
  run_case("module_list_entries", [&] {
    // ModuleList and ModuleDict entries named by path_policy are units, their call site
    // fsdp::call; training equals the unwrapped model's (where fsdp::call is a plain call).
    auto model = FullyShardedDataParallel(ListNet(), pg, Options().auto_wrap_policy(path_policy({"blocks.*", "heads.out"})));
    EXPECT_EQ(model->unit_paths(), (std::vector<std::string>{"blocks.0", "blocks.1", "heads.out"}));
    auto ref = ListNet();
    torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = global_batch(s, 12);
      ref_opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(ref->forward(x), y).backward();
      ref_opt.step();
      opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(model->forward(rank_slice(x, pg.rank(), n)), rank_slice(y, pg.rank(), n)).backward();
      opt.step();
    }
    std::map<std::string, torch::Tensor> want;
    for (const auto& p : ref->named_parameters()) want[p.key()] = p.value().detach();
    expect_matches(full_params(model), want, "module_list_entries");
    // Other policies leave entries inside their parent's unit (a forward may call them
    // directly); a forward that skips fsdp::call for an entry unit is named.
    EXPECT_EQ(FullyShardedDataParallel(ListNet(), pg, Options().auto_wrap_policy(always_wrap_policy()))->unit_paths(),
              (std::vector<std::string>{""}));
    auto direct = FullyShardedDataParallel(ListNet(/*direct=*/true), pg,
                                           Options().auto_wrap_policy(path_policy({"blocks.*"})));
    expect_error([&] { direct->forward(torch::randn({2, 13})); },
                 "each as fsdp::call<Impl>(list, i, args...)", "an entry called directly");
  });
  device_cases(pg);
}

}  // namespace

TEST(FsdpOptions, WorldSizes1To3) {
  for (int n = 1; n <= 3; ++n) run_ranks(n, option_cases);
}
