// FSDP features beyond plain training: no_sync and gradient
// accumulation, clip_grad_norm_, evaluation between steps, unused branches,
// frozen parameters, construction checks, parameter identity and memory_stats.
// Every check compares with an independent reference: the same model trained
// unsharded in one process on the global batch from the same initial weights
// (torch::nn::utils::clip_grad_norm_ for clipping), or a closed form.
// One spawn per world size runs every case (see harness/multirank.h).
#include <cmath>
#include <limits>
#include <set>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

using ParamMap = std::map<std::string, torch::Tensor>;

const ShardingStrategy kStrategies[] = {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                        ShardingStrategy::kNoShard};

ParamMap snapshot(torch::nn::Module& m) {
  ParamMap out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

/// Parameters without duplicates (tied parameters appear once).
std::vector<torch::Tensor> unique_params(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (auto& p : m.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

void expect_close(const ParamMap& got, const ParamMap& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [k, w] : want) {
    ASSERT_TRUE(got.count(k)) << what << ": missing " << k;
    EXPECT_LT(rel_diff(got.at(k), w), tol) << what << ": " << k;
  }
}

/// The update each parameter received (after - before) matches the reference's:
/// with plain SGD this compares the gradients themselves, not just the weights.
/// Gradients are summed in a different order than in the reference (per-rank
/// slices, then across ranks), so a small gradient with cancellation (a LayerNorm
/// weight) differs by a few 1e-5 relative after one step; weights stay < 1e-5.
constexpr double kUpdateTol = 1e-4;
void expect_same_update(const ParamMap& got0, const ParamMap& got1, const ParamMap& want0,
                        const ParamMap& want1, double tol, const std::string& what) {
  for (const auto& [k, w1] : want1) {
    ASSERT_TRUE(got1.count(k) && got0.count(k)) << what << ": missing " << k;
    auto dw = (w1 - want0.at(k)).to(torch::kDouble);
    auto dg = (got1.at(k) - got0.at(k)).to(torch::kDouble);
    if (dw.norm().item().toDouble() == 0) {
      EXPECT_EQ(dg.norm().item().toDouble(), 0) << what << ": " << k << " should not change";
    } else {
      EXPECT_LT(rel_diff(dg, dw), tol) << what << ": update of " << k;
    }
  }
}

bool pieces_expected(const Options& o, const comm::ProcessGroup& pg) {
  return o.sharding_strategy() != ShardingStrategy::kNoShard && pg.size() > 1;
}

template <typename Impl>
void expect_pieces(FullyShardedDataParallel<Impl>& m, const Options& o, const comm::ProcessGroup& pg,
                   const std::string& what) {
  if (!pieces_expected(o, pg)) return;
  for (const auto& p : m->named_parameters()) EXPECT_EQ(p.value().dim(), 1) << what << ": " << p.key();
}

// Model families shared by several cases: an MLP whose Linear layers are
// Sequential-entry units, and a transformer with nested Wrappable units and a root.
struct Family {
  std::string name;
  std::function<torch::nn::Sequential()> mlp;
};

Options mlp_options(ShardingStrategy s) { return Options().sharding_strategy(s).auto_wrap_policy(always_wrap_policy()); }
Options tf_options(ShardingStrategy s) { return Options().sharding_strategy(s).auto_wrap_policy(size_based_policy(100)); }

// ---------------------------------------------------------------------------
// 1. no_sync / gradient accumulation over k micro-batches == one step on the
//    concatenated batch.

template <typename Make>
void no_sync_case(comm::ProcessGroup& pg, const std::string& name, Make make, const Options& opts,
                  bool use_no_sync) {
  run_case(name, [&] {
    const int k = 3, rounds = 2;
    const double lr = 0.2;
    auto ref = make();
    torch::optim::SGD ref_opt(ref->parameters(), lr);
    auto model = FullyShardedDataParallel(make(), pg, opts);
    torch::optim::SGD opt(model->parameters(), lr);
    for (int r = 0; r < rounds; ++r) {
      std::vector<torch::Tensor> xs, ys;
      for (int i = 0; i < k; ++i) {
        auto [x, y] = global_batch(10 * r + i, 12);
        xs.push_back(x);
        ys.push_back(y);
      }
      auto ref0 = snapshot(*ref);
      auto got0 = full_params(model);
      ref_opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(ref->forward(torch::cat(xs)), torch::cat(ys)).backward();
      ref_opt.step();

      opt.zero_grad(/*set_to_none=*/false);
      for (int i = 0; i < k; ++i) {
        auto x = rank_slice(xs[i], pg.rank(), pg.size());
        auto y = rank_slice(ys[i], pg.rank(), pg.size());
        auto micro = [&] { (torch::mse_loss(model->forward(x), y) / k).backward(); };
        if (use_no_sync && i < k - 1) {
          auto guard = model->no_sync();
          micro();
        } else {
          micro();
        }
        expect_pieces(model, opts, pg, "after micro-batch " + std::to_string(i));
        if (i == 0) {
          // An evaluation in the middle of accumulation leaves it alone.
          torch::NoGradGuard no_grad;
          (void)model->forward(x);
        }
      }
      opt.step();
      auto got1 = full_params(model);
      expect_same_update(got0, got1, ref0, snapshot(*ref), kUpdateTol, "round " + std::to_string(r));
      expect_close(got1, snapshot(*ref), 1e-5, "round " + std::to_string(r));
      EXPECT_EQ(model->memory_stats().unsharded_bytes, 0) << "no_sync gradients left behind";
    }
  });
}

// ---------------------------------------------------------------------------
// 2. clip_grad_norm_ == torch::nn::utils::clip_grad_norm_ on the reference.

template <typename Make>
void clip_case(comm::ProcessGroup& pg, const std::string& name, Make make, const Options& opts,
               double max_norm, double norm_type) {
  run_case(name, [&] {
    const double lr = 0.2;
    auto ref = make();
    torch::optim::SGD ref_opt(ref->parameters(), lr);
    auto model = FullyShardedDataParallel(make(), pg, opts);
    torch::optim::SGD opt(model->parameters(), lr);
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = global_batch(s, 12);
      auto ref0 = snapshot(*ref);
      auto got0 = full_params(model);
      ref_opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(ref->forward(x), y).backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm, norm_type);
      ref_opt.step();

      opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()))
          .backward();
      const double norm = model->clip_grad_norm_(max_norm, norm_type).item().toDouble();
      opt.step();
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "step " << s;
      expect_same_update(got0, full_params(model), ref0, snapshot(*ref), kUpdateTol, "step " + std::to_string(s));
    }
  });
}

// ---------------------------------------------------------------------------
// 3 + 7. Evaluation between steps (also between backward and step), identity.

template <typename Make>
void eval_case(comm::ProcessGroup& pg, const std::string& name, Make make, const Options& opts) {
  run_case(name, [&] {
    auto ref = make();
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto model = FullyShardedDataParallel(make(), pg, opts);
    std::vector<const c10::TensorImpl*> identity;
    for (auto& p : model->parameters()) identity.push_back(p.unsafeGetTensorImpl());
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto [xe, ye] = global_batch(100, 8);
    auto evaluate = [&](const std::string& when) {
      torch::NoGradGuard no_grad;
      model->eval();
      ref->eval();
      auto out = model->forward(xe);
      auto want = ref->forward(xe);
      model->train();
      ref->train();
      EXPECT_FALSE(out.requires_grad()) << when;
      EXPECT_LT(rel_diff(out, want), 1e-5) << "eval output " << when;
      expect_pieces(model, opts, pg, "after eval " + when);
      EXPECT_EQ(model->memory_stats().unsharded_bytes, 0) << "after eval " << when;
    };
    evaluate("before training");
    for (int s = 0; s < 4; ++s) {
      auto [x, y] = global_batch(s, 12);
      if (s == 2) {
        // A training forward whose output is dropped (no backward): the next
        // iteration starts from a clean sharded state.
        (void)model->forward(rank_slice(x, pg.rank(), pg.size()));
      }
      ref_opt.zero_grad(/*set_to_none=*/false);
      auto ref_loss = torch::mse_loss(ref->forward(x), y);
      ref_loss.backward();
      // Step 3 zeroes the gradients between forward and backward (a common
      // order): the previous step's gradient pieces must be the ones zeroed.
      if (s != 3) opt.zero_grad(/*set_to_none=*/false);
      auto loss = torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())),
                                  rank_slice(y, pg.rank(), pg.size()));
      if (s == 3) opt.zero_grad(/*set_to_none=*/false);
      loss.backward();
      if (s == 1) {
        // Between backward and step: gradient pieces must survive the evaluation
        // (ref is evaluated before its step too).
        evaluate("between backward and step " + std::to_string(s));
      }
      ref_opt.step();
      opt.step();
      auto l = loss.detach().to(torch::kDouble).reshape({1});
      comm::all_reduce(pg, l, comm::ReduceOp::kAvg).wait();
      EXPECT_NEAR(l.item().toDouble(), ref_loss.item().toDouble(), 1e-5 * ref_loss.item().toDouble()) << "step " << s;
      evaluate("after step " + std::to_string(s));
    }
    auto params = model->parameters();
    ASSERT_EQ(params.size(), identity.size());
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].unsafeGetTensorImpl(), identity[i]) << i;
    expect_close(full_params(model), snapshot(*ref), 1e-5, "final");
    params = model->parameters();  // after apply_with_full_params too
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].unsafeGetTensorImpl(), identity[i]) << i;
    expect_pieces(model, opts, pg, "after apply_with_full_params");
  });
}

// ---------------------------------------------------------------------------
// 4. Unused branch: a Wrappable unit whose output some ranks (or all) ignore.

struct BranchNetImpl : torch::nn::Module {
  explicit BranchNetImpl(bool branch_first) : branch_first(branch_first) {
    trunk = register_module("trunk", torch::nn::Linear(13, 16));
    branch = register_module("branch", fsdp::Wrappable<torch::nn::LinearImpl>(16, 5));
    head = register_module("head", fsdp::Wrappable<torch::nn::LinearImpl>(16, 5));
  }
  torch::Tensor forward(torch::Tensor x, bool use_branch) {
    auto h = torch::relu(trunk->forward(x));
    torch::Tensor b, out;
    if (branch_first) {
      b = branch->forward(h);
      out = head->forward(h);
    } else {
      out = head->forward(h);
      b = branch->forward(h);
    }
    return use_branch ? out + b : out;
  }
  bool branch_first;
  torch::nn::Linear trunk{nullptr};
  fsdp::Wrappable<torch::nn::LinearImpl> branch{nullptr}, head{nullptr};
};
TORCH_MODULE(BranchNet);

/// The same with the branch and head as Sequential entries (units "branch.0",
/// "head.0"), and the unused branch's output cut by detach() * 0 instead.
struct SeqBranchNetImpl : torch::nn::Module {
  SeqBranchNetImpl() {
    trunk = register_module("trunk", torch::nn::Linear(13, 16));
    branch = register_module("branch", torch::nn::Sequential(torch::nn::Linear(16, 5), torch::nn::Tanh()));
    head = register_module("head", torch::nn::Sequential(torch::nn::Linear(16, 5)));
  }
  torch::Tensor forward(torch::Tensor x, bool use_branch) {
    auto h = torch::relu(trunk->forward(x));
    auto b = branch->forward(h);
    auto out = head->forward(h);
    return use_branch ? out + b : out + b.detach() * 0;
  }
  torch::nn::Linear trunk{nullptr};
  torch::nn::Sequential branch{nullptr}, head{nullptr};
};
TORCH_MODULE(SeqBranchNet);

template <typename Make>
void unused_branch_case(comm::ProcessGroup& pg, const std::string& name, ShardingStrategy strategy, Make make,
                        std::vector<std::string> expected_units, std::function<bool(int rank)> uses_branch,
                        int micro = 1, bool use_no_sync = false) {
  run_case(name, [&] {
    const Options opts = Options().sharding_strategy(strategy).auto_wrap_policy(always_wrap_policy());
    const int n = pg.size();
    auto ref = make();
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto model = FullyShardedDataParallel(make(), pg, opts);
    ASSERT_EQ(model->unit_paths(), expected_units);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    bool anyone_uses = false;
    for (int r = 0; r < n; ++r) anyone_uses |= uses_branch(r);
    for (int s = 0; s < 3; ++s) {
      auto ref0 = snapshot(*ref);
      auto got0 = full_params(model);
      // Global loss: mean over micro-batches and ranks of the ranks' losses, each
      // with its own branch usage.
      ref_opt.zero_grad(/*set_to_none=*/false);
      torch::Tensor ref_loss = torch::zeros({});
      for (int i = 0; i < micro; ++i) {
        auto [x, y] = global_batch(10 * s + i, 12);
        for (int r = 0; r < n; ++r)
          ref_loss = ref_loss + torch::mse_loss(ref->forward(rank_slice(x, r, n), uses_branch(r)), rank_slice(y, r, n));
      }
      (ref_loss / (n * micro)).backward();
      ref_opt.step();

      opt.zero_grad(/*set_to_none=*/false);
      for (int i = 0; i < micro; ++i) {
        auto [x, y] = global_batch(10 * s + i, 12);
        auto run = [&] {
          (torch::mse_loss(model->forward(rank_slice(x, pg.rank(), n), uses_branch(pg.rank())),
                           rank_slice(y, pg.rank(), n)) /
           micro)
              .backward();
        };
        if (use_no_sync && i < micro - 1) {
          auto guard = model->no_sync();
          run();
        } else {
          run();
        }
      }
      for (const auto& p : model->named_parameters()) {
        ASSERT_TRUE(p.value().grad().defined()) << p.key() << " has no gradient piece";
        if (!anyone_uses && p.key().rfind("branch.", 0) == 0) {
          EXPECT_EQ(p.value().grad().abs().sum().item().toDouble(), 0) << p.key();
        }
      }
      opt.step();
      expect_same_update(got0, full_params(model), ref0, snapshot(*ref), kUpdateTol, "step " + std::to_string(s));
      EXPECT_EQ(model->memory_stats().unsharded_bytes, 0);
    }
    expect_close(full_params(model), snapshot(*ref), 1e-5, "final");
  });
}

// ---------------------------------------------------------------------------
// 5. Frozen parameters under AdamW with weight decay.

template <typename Make>
void frozen_case(comm::ProcessGroup& pg, const std::string& name, Make make, const Options& opts,
                 const std::string& frozen_prefix) {
  run_case(name, [&] {
    auto ref = make();
    auto initial = snapshot(*ref);
    std::set<std::string> frozen;
    for (const auto& p : ref->named_parameters())
      if (!p.value().requires_grad()) frozen.insert(p.key());
    ASSERT_FALSE(frozen.empty());
    for (const auto& f : frozen) ASSERT_EQ(f.rfind(frozen_prefix, 0), 0u) << f;
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto model = FullyShardedDataParallel(make(), pg, opts);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int s = 0; s < 4; ++s) {
      auto [x, y] = global_batch(s, 12);
      ref_opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(ref->forward(x), y).backward();
      ref_opt.step();
      opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()))
          .backward();
      for (const auto& p : model->named_parameters()) {
        if (frozen.count(p.key())) {
          EXPECT_FALSE(p.value().requires_grad()) << p.key();
          EXPECT_FALSE(p.value().grad().defined()) << p.key() << " (frozen) got a gradient";
        } else {
          EXPECT_TRUE(p.value().grad().defined()) << p.key();
        }
      }
      opt.step();
      expect_pieces(model, opts, pg, "step " + std::to_string(s));
    }
    auto got = full_params(model);
    auto want = snapshot(*ref);
    for (const auto& f : frozen) {
      EXPECT_TRUE(torch::equal(got.at(f), initial.at(f))) << f << " (frozen) changed";
      EXPECT_TRUE(torch::equal(want.at(f), initial.at(f))) << f << " (frozen) changed in the reference";
    }
    expect_close(got, want, 1e-5, "final");
  });
}

// ---------------------------------------------------------------------------
// 6. Construction checks; tied parameters.

struct SharedLinearImpl : torch::nn::Module {
  SharedLinearImpl(int64_t d, torch::Tensor shared) {
    weight = register_parameter("weight", shared.defined() ? shared : torch::randn({d, d}) * 0.3);
    bias = register_parameter("bias", torch::randn({d}) * 0.1);
  }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(torch::linear(x, weight, bias)); }
  torch::Tensor weight, bias;
};

struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl() {
    inp = register_module("inp", torch::nn::Linear(13, 8));
    a = register_module("a", fsdp::Wrappable<SharedLinearImpl>(8, torch::Tensor()));
    b = register_module("b", fsdp::Wrappable<SharedLinearImpl>(8, a->weight));
    out = register_module("out", torch::nn::Linear(8, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return out->forward(b->forward(a->forward(inp->forward(x)))); }
  torch::nn::Linear inp{nullptr}, out{nullptr};
  fsdp::Wrappable<SharedLinearImpl> a{nullptr}, b{nullptr};
};
TORCH_MODULE(TiedNet);

TiedNet make_tied() {
  torch::manual_seed(3);
  return TiedNet();
}

/// Runs fn, expects a c10::Error whose message contains every needle.
template <typename Fn>
void expect_error(Fn fn, std::vector<std::string> needles, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << what << ": '" << n << "' not in: " << msg;
  }
}

// train()/eval() on the wrapper reach the user's root module too, not only the
// children the wrapper registers: a root forward that reads is_training() (dropout
// written in the root, a Trainer's eval) must see the mode the user set.
void train_mode_case(comm::ProcessGroup& pg) {
  run_case("train-eval/root", [&] {
    torch::manual_seed(0);
    auto m = torch::nn::Sequential(torch::nn::Linear(13, 32), torch::nn::Dropout(0.5), torch::nn::Linear(32, 5));
    auto model = FullyShardedDataParallel(m, pg, mlp_options(ShardingStrategy::kFullShard));
    model->eval();
    EXPECT_FALSE(m->is_training());
    for (const auto& c : m->modules()) EXPECT_FALSE(c->is_training()) << c->name();
    model->train();
    EXPECT_TRUE(m->is_training());
    for (const auto& c : m->modules()) EXPECT_TRUE(c->is_training()) << c->name();
  });
}

void construction_cases(comm::ProcessGroup& pg) {
  if (pg.size() > 1) {
    run_case("construct/different-models", [&] {
      torch::manual_seed(0);
      const int64_t hidden = pg.rank() == 1 ? 33 : 32;
      auto m = torch::nn::Sequential(torch::nn::Linear(13, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, 5));
      expect_error([&] { FullyShardedDataParallel(m, pg, mlp_options(ShardingStrategy::kFullShard)); },
                   {"differs", "rank 1", "0.weight"}, "different models");
      // The group is still usable: the check did not leave a collective behind.
      auto t = torch::ones({1});
      comm::all_reduce(pg, t).wait();
      EXPECT_EQ(t.item().toFloat(), pg.size());
    });
  }
  run_case("construct/wrap-twice", [&] {
    auto mlp = make_mlp();
    auto once = FullyShardedDataParallel(mlp, pg, mlp_options(ShardingStrategy::kFullShard));
    expect_error([&] { FullyShardedDataParallel(mlp, pg, mlp_options(ShardingStrategy::kFullShard)); },
                 {"already", "once"}, "Sequential wrapped twice");
    auto tf = make_transformer();
    auto tf_once = FullyShardedDataParallel(tf, pg, tf_options(ShardingStrategy::kFullShard));
    expect_error([&] { FullyShardedDataParallel(tf, pg, tf_options(ShardingStrategy::kFullShard)); },
                 {"already", "once"}, "Wrappable wrapped twice");
    expect_error([&] { FullyShardedDataParallel(tf_once.ptr(), pg, Options()); }, {"already", "once"},
                 "wrapper wrapped");
  });
  run_case("construct/to-clone-save-rejected", [&] {
    auto m = FullyShardedDataParallel(make_mlp(), pg, mlp_options(ShardingStrategy::kFullShard));
    expect_error([&] { m->to(torch::kDouble); }, {"to(", "before wrapping"}, "to(kDouble)");
    expect_error([&] { m->to(torch::Device(torch::kCPU)); }, {"to(", "before wrapping"}, "to(cpu)");
    expect_error([&] { m->clone(); }, {"cannot be cloned"}, "clone()");
    std::ostringstream os;
    expect_error([&] { torch::save(m, os); }, {"save_checkpoint"}, "torch::save");
    // Still trains after the rejected calls (nothing was half-converted).
    for (const auto& p : m->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  });
  run_case("construct/tied-across-units", [&] {
    expect_error([&] { FullyShardedDataParallel(make_tied(), pg, Options().auto_wrap_policy(always_wrap_policy())); },
                 {"module 'a'", "module 'b'", "tied"}, "tied across units");
  });
  for (auto strategy : kStrategies) {
    run_case(std::string("construct/tied-in-one-unit/") + to_string(strategy), [&] {
      auto ref = make_tied();
      auto ref_params = unique_params(*ref);
      ASSERT_EQ(ref_params.size(), 7u);  // a.weight == b.weight
      torch::optim::AdamW ref_opt(ref_params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      const Options opts = Options().sharding_strategy(strategy);
      auto model = FullyShardedDataParallel(make_tied(), pg, opts);
      auto params = unique_params(*model);
      ASSERT_EQ(params.size(), 7u);
      torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      for (int s = 0; s < 4; ++s) {
        auto [x, y] = global_batch(s, 12);
        ref_opt.zero_grad(/*set_to_none=*/false);
        torch::mse_loss(ref->forward(x), y).backward();
        ref_opt.step();
        opt.zero_grad(/*set_to_none=*/false);
        torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()))
            .backward();
        opt.step();
      }
      auto got = full_params(model);
      EXPECT_TRUE(torch::equal(got.at("a.weight"), got.at("b.weight")));
      expect_close(got, snapshot(*ref), 1e-5, "tied");
      EXPECT_EQ(model->module()->a->weight.unsafeGetTensorImpl(), model->module()->b->weight.unsafeGetTensorImpl());
    });
  }
}

// ---------------------------------------------------------------------------
// 8. memory_stats against closed forms.

template <typename Make>
void memory_case(comm::ProcessGroup& pg, const std::string& name, Make make, const Options& opts) {
  run_case(name, [&] {
    const int64_t n = pg.size();
    auto ref = make();
    std::map<std::string, int64_t> numel;
    for (const auto& p : ref->named_parameters()) numel[p.key()] = p.value().numel();
    auto model = FullyShardedDataParallel(make(), pg, opts);
    const auto strategy = opts.sharding_strategy();
    const auto paths = model->unit_paths();
    int64_t shard_bytes = 0, unsharded_all = 0, largest_unit = 0, root_unsharded = 0, largest_flat_grad = 0;
    std::vector<int64_t> unit_full_bytes;  // of the non-root units, in forward order
    for (size_t i = 0; i < paths.size(); ++i) {
      int64_t psi = 0;
      for (const auto& fqn : model->unit_parameter_names(i)) psi += numel.at(fqn);
      const int64_t chunk = strategy == ShardingStrategy::kNoShard ? psi : (psi + n - 1) / n;  // padded chunk
      shard_bytes += 4 * chunk;
      const int64_t full = strategy == ShardingStrategy::kNoShard ? 0 : 4 * chunk * n;
      unsharded_all += full;
      largest_unit = std::max(largest_unit, full);
      // Every unit's flat gradient (padded) exists while it is reduced.
      largest_flat_grad = std::max(largest_flat_grad, strategy == ShardingStrategy::kNoShard ? 4 * psi : full);
      if (paths[i].empty()) root_unsharded = full;
      else unit_full_bytes.push_back(full);
    }
    torch::optim::Adam opt(model->parameters(), 1e-2);
    for (int s = 0; s < 2; ++s) {
      auto [x, y] = global_batch(s, 12);
      opt.zero_grad(/*set_to_none=*/false);
      model->reset_peak_memory_stats();
      auto loss = torch::mse_loss(model->forward(rank_slice(x, pg.rank(), n)), rank_slice(y, pg.rank(), n));
      auto mid = model->memory_stats();
      // Between forward and backward: FULL_SHARD keeps only the root gathered,
      // and from the second iteration on the two units that finished forward last
      // (BACKWARD_PRE, the default: [Note: last unit stays gathered]); SHARD_GRAD_OP
      // keeps every unit gathered. Which two depends on the nesting (an outer unit
      // finishes forward after its inner ones): for the mlp, whose units run in
      // path order, the last two paths; otherwise some two units.
      if (strategy == ShardingStrategy::kFullShard) {
        if (s == 0 || unit_full_bytes.empty()) {
          EXPECT_EQ(mid.unsharded_bytes, root_unsharded) << s;
        } else if (unit_full_bytes.size() == 1) {
          EXPECT_EQ(mid.unsharded_bytes - root_unsharded, unit_full_bytes[0]) << s;
        } else {
          const int64_t kept = mid.unsharded_bytes - root_unsharded;
          bool two_units = false;
          for (size_t i = 0; i < unit_full_bytes.size(); ++i)
            for (size_t j = i + 1; j < unit_full_bytes.size(); ++j)
              two_units = two_units || unit_full_bytes[i] + unit_full_bytes[j] == kept;
          EXPECT_TRUE(two_units) << s << ": " << mid.unsharded_bytes << " gathered, root " << root_unsharded;
          if (name.find("/mlp/") != std::string::npos) {
            EXPECT_EQ(kept, unit_full_bytes[unit_full_bytes.size() - 2] + unit_full_bytes.back()) << s;
          }
        }
      }
      if (strategy == ShardingStrategy::kShardGradOp) {
        EXPECT_EQ(mid.unsharded_bytes, unsharded_all) << s;
      }
      if (strategy == ShardingStrategy::kNoShard) {
        EXPECT_EQ(mid.unsharded_bytes, 0) << s;
      }
      loss.backward();
      opt.step();
      auto ms = model->memory_stats();
      EXPECT_EQ(ms.param_shard_bytes, shard_bytes) << s;
      int64_t grad_bytes = 0, piece_bytes = 0;
      for (auto& p : unique_params(*model)) {
        ASSERT_TRUE(p.grad().defined());
        grad_bytes += p.grad().numel() * 4;
        piece_bytes += p.numel() * 4;
      }
      EXPECT_EQ(ms.grad_shard_bytes, grad_bytes) << s;
      EXPECT_EQ(ms.grad_shard_bytes, piece_bytes) << s;  // one gradient element per piece element
      EXPECT_EQ(ms.unsharded_bytes, 0) << s;
      if (strategy == ShardingStrategy::kShardGradOp) {
        EXPECT_GE(ms.unsharded_peak_bytes, unsharded_all) << s;
      }
      if (strategy == ShardingStrategy::kFullShard) {
        EXPECT_GE(ms.unsharded_peak_bytes, std::max(largest_unit, root_unsharded)) << s;
      }
      EXPECT_GE(ms.unsharded_peak_bytes, largest_flat_grad) << s;
    }
  });
}

// ---------------------------------------------------------------------------

/// First layer frozen: its output does not require grad, so its unit has no
/// backward at all.
torch::nn::Sequential make_frozen_first_mlp() {
  auto m = make_mlp();
  for (auto& p : m->ptr(0)->parameters()) p.requires_grad_(false);
  return m;
}
/// A whole block frozen: a frozen unit with frozen nested units between
/// trainable ones.
TinyTransformer make_frozen_block_transformer() {
  auto t = make_transformer();
  for (auto& p : t->blocks[0]->parameters()) p.requires_grad_(false);
  return t;
}
/// A frozen layer in the root unit next to trainable ones.
TinyTransformer make_frozen_root_transformer() {
  auto t = make_transformer();
  for (auto& p : t->proj->parameters()) p.requires_grad_(false);
  return t;
}
torch::nn::Sequential make_frozen_mlp() {
  auto m = make_mlp();
  for (auto& p : m->ptr(2)->parameters()) p.requires_grad_(false);
  return m;
}
TinyTransformer make_frozen_transformer() {
  auto t = make_transformer();
  for (auto& p : t->blocks[0]->mix->parameters()) p.requires_grad_(false);
  return t;
}

void all_cases(comm::ProcessGroup& pg) {
  auto mlp = [] { return make_mlp(); };
  auto tf = [] { return make_transformer(); };
  for (auto strategy : kStrategies) {
    const std::string s = to_string(strategy);
    for (bool ns : {true, false}) {
      const std::string mode = ns ? "/no_sync" : "/accumulate";
      no_sync_case(pg, "no_sync/mlp/" + s + mode, mlp, mlp_options(strategy), ns);
      no_sync_case(pg, "no_sync/transformer/" + s + mode, tf, tf_options(strategy), ns);
    }
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      const std::string nt = std::isinf(norm_type) ? "inf" : "2";
      clip_case(pg, "clip/mlp/" + s + "/" + nt, mlp, mlp_options(strategy), 0.05, norm_type);
      clip_case(pg, "clip/transformer/" + s + "/" + nt, tf, tf_options(strategy), 0.05, norm_type);
    }
    clip_case(pg, "clip/transformer/" + s + "/no-clip", tf, tf_options(strategy), 1e4, 2.0);
    clip_case(pg, "clip/transformer/" + s + "/1", tf, tf_options(strategy), 0.05, 1.0);
    eval_case(pg, "eval/mlp/" + s, mlp, mlp_options(strategy));
    eval_case(pg, "eval/transformer/" + s, tf, tf_options(strategy));
    eval_case(pg, "eval/mlp-root-only/" + s, mlp, Options().sharding_strategy(strategy));
    auto some = [](int r) { return r % 2 == 0; };
    auto none = [](int) { return false; };
    for (bool first : {true, false}) {
      const std::string order = first ? "/branch-first" : "/head-first";
      auto make = [first] {
        torch::manual_seed(7);
        return BranchNet(first);
      };
      const std::vector<std::string> units{"", "branch", "head"};
      unused_branch_case(pg, "unused/some-ranks/" + s + order, strategy, make, units, some);
      unused_branch_case(pg, "unused/all-ranks/" + s + order, strategy, make, units, none);
    }
    auto make_seq = [] {
      torch::manual_seed(7);
      return SeqBranchNet();
    };
    const std::vector<std::string> seq_units{"", "branch.0", "head.0"};
    unused_branch_case(pg, "unused/some-ranks/sequential/" + s, strategy, make_seq, seq_units, some);
    unused_branch_case(pg, "unused/all-ranks/sequential/" + s, strategy, make_seq, seq_units, none);
    unused_branch_case(pg, "unused/some-ranks/sequential/no_sync/" + s, strategy, make_seq, seq_units, some, 2, true);
    unused_branch_case(pg, "unused/some-ranks/sequential/accumulate/" + s, strategy, make_seq, seq_units, some, 2,
                       false);
    frozen_case(pg, "frozen/mlp/" + s, make_frozen_mlp, mlp_options(strategy), "2.");
    frozen_case(pg, "frozen/mlp-root-only/" + s, make_frozen_mlp, Options().sharding_strategy(strategy), "2.");
    frozen_case(pg, "frozen/transformer/" + s, make_frozen_transformer, tf_options(strategy), "block0.mix.");
    frozen_case(pg, "frozen/transformer-root/" + s, make_frozen_root_transformer, tf_options(strategy), "proj.");
    frozen_case(pg, "frozen/mlp-first/" + s, make_frozen_first_mlp, mlp_options(strategy), "0.");
    frozen_case(pg, "frozen/transformer-block/" + s, make_frozen_block_transformer, tf_options(strategy), "block0.");
    memory_case(pg, "memory/mlp/" + s, mlp, mlp_options(strategy));
    memory_case(pg, "memory/transformer/" + s, tf, tf_options(strategy));
  }
  construction_cases(pg);
  train_mode_case(pg);
}

}  // namespace

TEST(FsdpFeatures, World1) { run_ranks(1, all_cases); }
TEST(FsdpFeatures, World2) { run_ranks(2, all_cases); }
TEST(FsdpFeatures, World3) { run_ranks(3, all_cases); }
