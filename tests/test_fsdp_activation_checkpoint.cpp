// Activation checkpointing under FSDP and ZeRO: training with fsdp::checkpoint is bit for
// bit the training without it (gradients after every backward, parameters after 3 Adam
// steps; dropout inside the checkpointed pieces), at N = 1..3, FULL_SHARD, SHARD_GRAD_OP,
// NO_SHARD (and HYBRID_SHARD at N=2), bf16 mixed precision, with a unit inside a checkpointed block (the block
// is the unit, or holds nested units) and a checkpointed piece inside a unit; the
// recompute's gathers are the backward gathers (the trace shows them before each
// recompute, and FULL_SHARD moves the same bytes as without checkpointing); ZeRO-2's
// end-of-backward waits for the outermost backward. The reference is the same training
// without checkpointing, in the same process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/autograd/checkpoint_wrapper.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/trained_state.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

// A pre-norm block with dropout in both branches; optionally its MLP is checkpointed
// inside the block's own forward (a checkpointed piece inside a unit).
struct DropBlockImpl : torch::nn::Module {
  DropBlockImpl(int64_t dim, bool checkpoint_mlp) : checkpoint_mlp_(checkpoint_mlp) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    mix = register_module("mix", torch::nn::Linear(dim, dim));
    drop = register_module("drop", torch::nn::Dropout(0.2));
    mlp = register_module("mlp", torch::nn::Sequential(torch::nn::Linear(dim, 2 * dim + 1), torch::nn::GELU(),
                                                         torch::nn::Dropout(0.1), torch::nn::Linear(2 * dim + 1, dim)));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + drop(mix(norm(x)));
    auto f = [this](const torch::Tensor& h) { return mlp->forward(h); };
    return x + (checkpoint_mlp_ ? fsdp::checkpoint(f, x) : f(x));
  }
  bool checkpoint_mlp_;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear mix{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::Sequential mlp{nullptr};
};

struct NetImpl : torch::nn::Module {
  NetImpl(int layers, bool checkpoint_mlp) {
    proj = register_module("proj", torch::nn::Linear(13, 16));
    for (int i = 0; i < layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), Wrappable<DropBlockImpl>(16, checkpoint_mlp)));
    head = register_module("head", torch::nn::Linear(16, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = proj(x);
    for (auto& b : blocks) x = b->forward(x);
    return head(x);
  }
  torch::nn::Linear proj{nullptr}, head{nullptr};
  std::vector<Wrappable<DropBlockImpl>> blocks;
};
TORCH_MODULE(Net);

// Where the checkpoint goes.
enum class Ckpt { None, UnitInside, InsideUnit };
const char* to_string(Ckpt c) { return c == Ckpt::None ? "none" : c == Ckpt::UnitInside ? "unit-inside" : "inside-unit"; }

Net make_net(Ckpt c, int layers = 3) {
  torch::manual_seed(0);
  Net net(layers, c == Ckpt::InsideUnit);
  if (c == Ckpt::UnitInside) {
    EXPECT_EQ(apply_activation_checkpointing(*net, checkpoint_module_type<DropBlockImpl>()), layers);
  }
  return net;
}

// What one training run leaves on this rank: its gradient pieces after every backward
// and its parameter pieces at the end, and the collective bytes of every step.
struct Run : TrainedState {
  std::vector<int64_t> gather_bytes, reduce_bytes;
};

// Dropout draws from a per-rank, per-step seed, the same in every run.
torch::Tensor rank_loss(torch::nn::Module& m, const std::function<torch::Tensor(torch::Tensor)>& fwd,
                        comm::ProcessGroup& pg, int step) {
  auto [x, y] = global_batch(step, 12);
  torch::manual_seed(100 + 10 * step + pg.rank());
  return torch::mse_loss(fwd(rank_slice(x, pg.rank(), pg.size())).to(torch::kFloat), rank_slice(y, pg.rank(), pg.size()));
}

Run train_fsdp(comm::ProcessGroup& pg, Ckpt c, const Options& options, int steps = 3) {
  auto model = FullyShardedDataParallel(make_net(c), pg, options);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  Run run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad(/*set_to_none=*/true);
    comm::comm_counters().reset();
    rank_loss(*model, [&](torch::Tensor x) { return model->forward(x); }, pg, s).backward();
    run.gather_bytes.push_back(comm::comm_counters().all_gather);
    run.reduce_bytes.push_back(comm::comm_counters().reduce_scatter);
    std::vector<torch::Tensor> g;
    for (auto& p : model->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    run.grads.push_back(g);
    opt.step();
  }
  for (auto& p : model->parameters()) run.params.push_back(p.detach().clone());
  return run;
}

void parity_cases(comm::ProcessGroup& pg) {
  struct Config {
    std::string name;
    Options options;
  };
  std::vector<Config> configs;
  for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
    configs.push_back({to_string(strategy), Options().sharding_strategy(strategy)
                                                .auto_wrap_policy(module_type_policy<DropBlockImpl>())});
  }
  configs.push_back({"NO_SHARD", Options().sharding_strategy(ShardingStrategy::kNoShard)
                                     .auto_wrap_policy(module_type_policy<DropBlockImpl>())});
  if (pg.size() % 2 == 0) {
    configs.push_back({"HYBRID_SHARD", Options().sharding_strategy(ShardingStrategy::kHybridShard)
                                           .shard_group_size(pg.size() / 2)
                                           .auto_wrap_policy(module_type_policy<DropBlockImpl>())});
  }
  configs.push_back({"FULL_SHARD/bf16", Options().auto_wrap_policy(module_type_policy<DropBlockImpl>())
                                            .mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16))});
  // Units inside units: the blocks' Linear layers are units of their own.
  configs.push_back({"FULL_SHARD/nested-units", Options().auto_wrap_policy(size_based_policy(100))});
  for (const auto& cfg : configs) {
    Run ref;
    run_case(cfg.name + "/reference", [&] { ref = train_fsdp(pg, Ckpt::None, cfg.options); });
    for (Ckpt c : {Ckpt::UnitInside, Ckpt::InsideUnit}) {
      run_case(cfg.name + "/" + to_string(c), [&] {
        Run run = train_fsdp(pg, c, cfg.options);
        expect_bitwise_equal(run, ref);
        // The recompute gathers through the backward schedule: not one byte more.
        EXPECT_EQ(run.gather_bytes, ref.gather_bytes);
        EXPECT_EQ(run.reduce_bytes, ref.reduce_bytes);
      });
    }
  }
}

const TraceSpan* find_span(const std::vector<TraceSpan>& spans, const std::string& name, bool last) {
  const TraceSpan* found = nullptr;
  for (const auto& s : spans)
    if (s.name == name && (last || found == nullptr)) found = &s;
  return found;
}

void trace_cases(comm::ProcessGroup& pg) {
  run_case("recompute-gathers-in-the-trace", [&] {
    auto options = Options().auto_wrap_policy(module_type_policy<DropBlockImpl>())
                       .trace_dir(worker_scratch_dir() + "/trace");
    auto model = FullyShardedDataParallel(make_net(Ckpt::UnitInside), pg, options);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    for (int s = 0; s < 2; ++s) {
      if (s == 1) model->clear_trace();  // the second step: the schedule recorded in the first
      opt.zero_grad(/*set_to_none=*/true);
      rank_loss(*model, [&](torch::Tensor x) { return model->forward(x); }, pg, s).backward();
      opt.step();
    }
    const auto spans = model->trace_spans();
    for (int b = 0; b < 3; ++b) {
      const std::string unit = "block" + std::to_string(b);
      const TraceSpan* recompute = find_span(spans, "recompute " + unit, false);
      ASSERT_NE(recompute, nullptr) << "no recompute of " << unit << " in the trace";
      const TraceSpan* forward = find_span(spans, "forward " + unit, false);
      ASSERT_NE(forward, nullptr);
      EXPECT_LT(forward->end_seq, recompute->begin_seq);
      int gathers = 0;
      for (const auto& sp : spans) gathers += sp.name == "all_gather " + unit;
      // block2 and block1 finished forward last: kept gathered ([Note: last unit stays
      // gathered]); block0 is gathered in forward and once more, for its recompute.
      EXPECT_EQ(gathers, b == 0 ? 2 : 1) << unit;
      const TraceSpan* gather = find_span(spans, "all_gather " + unit, true);
      ASSERT_NE(gather, nullptr);
      if (b == 0) {
        EXPECT_LE(gather->end_seq, recompute->begin_seq) << "the recompute ran before its gather completed";
      }
      const TraceSpan* backward = find_span(spans, "backward " + unit, false);
      ASSERT_NE(backward, nullptr);
      EXPECT_LT(recompute->end_seq, backward->end_seq);
    }
  });
  run_case("unit-parameter-on-both-sides-of-a-checkpoint-fails-clearly", [&] {
    // mix runs first outside the checkpoint and again inside it: its inner gradient comes
    // first, the unit's last (norm's) completes the unit, the outer one comes too late.
    struct SplitImpl : torch::nn::Module {
      SplitImpl() {
        mix = register_module("mix", torch::nn::Linear(13, 13));
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({13})));
      }
      torch::Tensor forward(torch::Tensor x) {
        auto h = norm(mix(x));
        return h + fsdp::checkpoint([this](const torch::Tensor& t) { return mix(t); }, h);
      }
      torch::nn::Linear mix{nullptr};
      torch::nn::LayerNorm norm{nullptr};
    };
    struct NetImpl2 : torch::nn::Module {
      NetImpl2() { split = register_module("split", Wrappable<SplitImpl>()); }
      torch::Tensor forward(torch::Tensor x) { return split->forward(x); }
      Wrappable<SplitImpl> split{nullptr};
    };
    auto model = FullyShardedDataParallel(std::make_shared<NetImpl2>(), pg,
                                          Options().auto_wrap_policy(module_type_policy<SplitImpl>()));
    try {
      model->forward(torch::randn({4, 13})).sum().backward();
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("parameter 'split.mix."), std::string::npos) << msg;
      EXPECT_NE(msg.find("received a second gradient"), std::string::npos) << msg;
      EXPECT_NE(msg.find("one side of the checkpoint"), std::string::npos) << msg;
    }
  });
  run_case("root-inside-a-checkpoint-fails-clearly", [&] {
    auto model = FullyShardedDataParallel(make_net(Ckpt::None), pg, Options());
    auto x = torch::randn({4, 13});
    try {
      fsdp::checkpoint([&](const torch::Tensor& t) { return model->forward(t); }, x);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("root's forward runs inside fsdp::checkpoint"), std::string::npos) << msg;
      EXPECT_NE(msg.find("apply_activation_checkpointing"), std::string::npos) << msg;
    }
  });
}

// ZeRO (stage 1 and 2) over a replicated model: the whole model but its input projection
// runs inside one checkpoint, so the first gradients arrive in the nested backward and
// the input projection's after it.
Run train_zero(comm::ProcessGroup& pg, int stage, bool checkpointed, int steps = 3) {
  Net net = make_net(Ckpt::None);
  optim::ZeroRedundancyOptimizer opt(net->parameters(),
                                     optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)),
                                     optim::ZeroOptions().process_group(pg).stage(stage).reduce_bucket_size(300));
  auto rest = [&](const torch::Tensor& h) {
    torch::Tensor x = h;
    for (auto& b : net->blocks) x = b->forward(x);
    return net->head(x);
  };
  auto fwd = [&](torch::Tensor x) {
    auto h = net->proj(x);
    return checkpointed ? fsdp::checkpoint(rest, h) : rest(h);
  };
  Run run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad(/*set_to_none=*/true);
    comm::comm_counters().reset();
    rank_loss(*net, fwd, pg, s).backward();
    run.reduce_bytes.push_back(comm::comm_counters().reduce_scatter + comm::comm_counters().all_reduce);
    opt.step();
  }
  for (auto& p : net->parameters()) run.params.push_back(p.detach().clone());
  return run;
}

void zero_cases(comm::ProcessGroup& pg) {
  for (int stage : {1, 2}) {
    run_case("zero" + std::to_string(stage), [&] {
      Run ref = train_zero(pg, stage, false);
      Run run = train_zero(pg, stage, true);
      expect_bitwise_equal(run, ref);
      EXPECT_EQ(run.reduce_bytes, ref.reduce_bytes) << "a bucket was reduced twice";
    });
  }
  run_case("zero2-parameter-on-both-sides-of-a-checkpoint-fails-clearly", [&] {
    Net net = make_net(Ckpt::None);
    optim::ZeroRedundancyOptimizer opt(net->parameters(),
                                       optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)),
                                       optim::ZeroOptions().process_group(pg).stage(2).module(net.ptr()));
    auto x = torch::randn({4, 13});
    auto h = net->proj(x);
    // proj's weight again inside the checkpoint: its gradient arrives in two parts.
    auto out = fsdp::checkpoint(
        [&](const torch::Tensor& a, const torch::Tensor& b) { return net->head(a + torch::linear(b, net->proj->weight)); },
        h, x);
    try {
      out.sum().backward();
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("proj.weight"), std::string::npos) << msg;
      EXPECT_NE(msg.find("received a second gradient"), std::string::npos) << msg;
      EXPECT_NE(msg.find("both inside and outside an activation checkpoint"), std::string::npos) << msg;
    }
  });
}

}  // namespace

TEST(FsdpActivationCheckpoint, BitwiseEqualToTrainingWithoutIt) {
  for (int n = 1; n <= 3; ++n) run_ranks(n, parity_cases);
}

TEST(FsdpActivationCheckpoint, RecomputeInTheTraceAndClearErrors) { run_ranks(2, trace_cases); }

TEST(FsdpActivationCheckpoint, ZeroStagesBitwiseEqual) { run_ranks(2, zero_cases); }
