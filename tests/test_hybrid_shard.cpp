// HYBRID_SHARD: sharded inside groups of shard_group_size consecutive ranks,
// replicated across them. At N=4, shard 2, training equals single-process
// training on the global batch (relative L2 < 2e-6, SGD+momentum and AdamW, MLP
// and nested transformer); gradients cross the replica group (all-reduce bytes
// equal to the ring all-reduce of every reduced shard); parameter memory per
// rank is half of NO_SHARD's; shard_group_size 4 gives FULL_SHARD's result and
// traffic shape, 1 gives NO_SHARD's. With bucket_cap_mb the results are
// bit-identical and the traffic the same; the replica all-reduce starts as soon as
// the shard group's reduce-scatter is complete and runs while backward continues
// (checked through the trace, whose collective spans also name the transport:
// shared memory here, Gloo under FSDP_SHARED_MEMORY=0).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "fsdp/comm/collectives.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

enum class Opt { SGD, AdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, torch::nn::Module& m) {
  if (opt == Opt::SGD)
    return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::AdamW>(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

struct RunResult {
  std::map<std::string, torch::Tensor> full;
  MemoryStats mem;
  int64_t all_reduce_bytes = 0, reduce_scatter_bytes = 0, all_gather_bytes = 0;
  int64_t max_param_dim = 0;
};

// Trains `steps` steps on this rank's slice of the global batch (no clipping, so
// the comm counters hold the training traffic only).
template <typename ModelFactory>
RunResult train(comm::ProcessGroup& pg, ModelFactory make, Options options, Opt opt, int steps = 5,
                int64_t batch = 16) {
  auto model = FullyShardedDataParallel(make(), pg, options);
  auto optim = make_optimizer(opt, *model);
  RunResult r;
  comm::comm_counters().reset();
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(s, batch);
    optim->zero_grad(/*set_to_none=*/false);
    // (.to(kFloat): under mixed precision the output is bf16)
    auto loss = torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())).to(torch::kFloat),
                                rank_slice(y, pg.rank(), pg.size()));
    loss.backward();
    optim->step();
  }
  r.all_reduce_bytes = comm::comm_counters().all_reduce;
  r.reduce_scatter_bytes = comm::comm_counters().reduce_scatter;
  r.all_gather_bytes = comm::comm_counters().all_gather;
  r.mem = model->memory_stats();
  for (auto& p : model->parameters()) r.max_param_dim = std::max<int64_t>(r.max_param_dim, p.dim());
  r.full = full_params(model);
  return r;
}

template <typename ModelFactory>
std::map<std::string, torch::Tensor> reference(ModelFactory make, Opt opt, int steps = 5, int64_t batch = 16) {
  auto ref = make();
  auto o = make_optimizer(opt, *ref.ptr());
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(s, batch);
    o->zero_grad(/*set_to_none=*/false);
    torch::mse_loss(ref->forward(x), y).backward();
    o->step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : ref->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

void expect_identical(const std::map<std::string, torch::Tensor>& got,
                      const std::map<std::string, torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [k, v] : want) EXPECT_TRUE(torch::equal(got.at(k), v)) << k << " differs";
}

// fp32 parity bound: 10x the largest difference measured (2.0e-7; float sums in
// another order than the single-process reference).
constexpr double kParityTol = 2e-6;

void expect_close(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want,
                  double tol) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (const auto& [k, v] : want) {
    ASSERT_TRUE(got.count(k)) << k;
    worst = std::max(worst, rel_diff(got.at(k), v));
    EXPECT_LT(rel_diff(got.at(k), v), tol) << k;
  }
  std::cout << "[close] worst rel. L2 " << worst << " (bound " << tol << ")\n";
}

// The identity, whose backward sleeps 300 ms: a stretch of backward with no unit in it.
struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return {grads[0]};
  }
};
torch::Tensor slow_backward_identity(torch::Tensor x) { return SlowBackward::apply(x); }

Options hybrid(int g, WrapPolicy policy) {
  return Options().sharding_strategy(ShardingStrategy::kHybridShard).shard_group_size(g).auto_wrap_policy(policy);
}

// Two SGD steps of `model` on the global batches of 16 (this rank's slice of 4); the
// trace spans of the second (the first step also records the unit order).
template <typename Model>
std::vector<TraceSpan> second_step_spans(Model& model, const comm::ProcessGroup& pg) {
  torch::optim::SGD o(model->parameters(), 0.05);
  for (int s = 0; s < 2; ++s) {
    model->clear_trace();
    auto [x, y] = global_batch(s, 16);
    o.zero_grad(/*set_to_none=*/false);
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), 4)), rank_slice(y, pg.rank(), 4)).backward();
    o.step();
  }
  return model->trace_spans();
}

TraceSpan find_span(const std::vector<TraceSpan>& spans, const std::string& name) {
  for (const auto& s : spans)
    if (s.name == name) return s;
  ADD_FAILURE() << "no span '" << name << "'";
  return TraceSpan{};
}

void hybrid_cases(comm::ProcessGroup& pg) {
  ASSERT_EQ(pg.size(), 4);
  auto mlp = [] { return make_mlp(); };
  auto tf = [] { return make_transformer(); };
  for (Opt opt : {Opt::SGD, Opt::AdamW}) {
    const std::string o = opt == Opt::SGD ? "sgd" : "adamw";
    run_case("parity/mlp/" + o, [&] {
      expect_close(train(pg, mlp, hybrid(2, always_wrap_policy()), opt).full, reference(mlp, opt), kParityTol);
    });
    run_case("parity/transformer/" + o, [&] {
      expect_close(train(pg, tf, hybrid(2, size_based_policy(100)), opt).full, reference(tf, opt), kParityTol);
    });
  }

  run_case("traffic-and-memory/shard2", [&] {
    auto h = train(pg, mlp, hybrid(2, always_wrap_policy()), Opt::SGD, /*steps=*/1);
    auto ns = train(pg, mlp, Options().sharding_strategy(ShardingStrategy::kNoShard)
                                 .auto_wrap_policy(always_wrap_policy()), Opt::SGD, 1);
    // One ring all-reduce over the 2-rank replica group per reduced shard moves
    // 2*(2-1)/2 = 1x the shard: exactly the parameter shard bytes.
    EXPECT_GT(h.all_reduce_bytes, 0);
    EXPECT_EQ(h.all_reduce_bytes, h.mem.param_shard_bytes);
    EXPECT_GT(h.reduce_scatter_bytes, 0);
    // Half of NO_SHARD's parameters, up to one padding element per unit (3 units).
    EXPECT_LE(std::abs(2 * h.mem.param_shard_bytes - ns.mem.param_shard_bytes), 3 * 4);
    EXPECT_EQ(ns.mem.param_shard_bytes, 1099 * 4);  // 13*32+32 + 32*17+17 + 17*5+5
    EXPECT_EQ(h.max_param_dim, 1);  // pieces outside forward/backward
  });

  run_case("shard4-is-full-shard", [&] {
    auto h = train(pg, tf, hybrid(4, size_based_policy(100)), Opt::AdamW);
    auto f = train(pg, tf, Options().sharding_strategy(ShardingStrategy::kFullShard)
                               .auto_wrap_policy(size_based_policy(100)), Opt::AdamW);
    expect_identical(h.full, f.full);
    EXPECT_EQ(h.all_reduce_bytes, 0);  // no replica group traffic
    EXPECT_EQ(h.reduce_scatter_bytes, f.reduce_scatter_bytes);
    EXPECT_EQ(h.all_gather_bytes, f.all_gather_bytes);
    EXPECT_EQ(h.mem.param_shard_bytes, f.mem.param_shard_bytes);
  });

  run_case("shard1-is-no-shard", [&] {
    auto h = train(pg, tf, hybrid(1, size_based_policy(100)), Opt::AdamW);
    auto n = train(pg, tf, Options().sharding_strategy(ShardingStrategy::kNoShard)
                               .auto_wrap_policy(size_based_policy(100)), Opt::AdamW);
    expect_identical(h.full, n.full);
    expect_close(h.full, reference(tf, Opt::AdamW), kParityTol);
    EXPECT_EQ(h.all_reduce_bytes, n.all_reduce_bytes);
    EXPECT_EQ(h.all_gather_bytes, 0);
    EXPECT_EQ(h.mem.param_shard_bytes, n.mem.param_shard_bytes);
    EXPECT_GT(h.max_param_dim, 1);  // full shapes, as NO_SHARD
  });

  run_case("clip-grad-norm-over-shard-group", [&] {
    // The norm of the averaged global gradient, computed by the reference.
    auto ref = make_mlp();
    auto [x, y] = global_batch(0, 16);
    torch::mse_loss(ref->forward(x), y).backward();
    double sq = 0;
    for (auto& p : ref->parameters()) sq += p.grad().pow(2).sum().item<double>();
    auto model = FullyShardedDataParallel(make_mlp(), pg, hybrid(2, always_wrap_policy()));
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), 4)), rank_slice(y, pg.rank(), 4)).backward();
    const double norm = model->clip_grad_norm_(1e9).item<double>();
    EXPECT_NEAR(norm, std::sqrt(sq), 1e-5 * std::sqrt(sq));
  });

  run_case("mixed-precision", [&] {
    // bf16 gathers and reductions, including the replica all-reduce: at
    // shard_group_size 4 exactly FULL_SHARD's result; at 2 within bf16 rounding
    // of fp32 single-process training.
    const auto mp = MixedPrecision().param_dtype(torch::kBFloat16).reduce_dtype(torch::kBFloat16);
    auto h4 = train(pg, mlp, hybrid(4, always_wrap_policy()).mixed_precision(mp), Opt::AdamW);
    auto f = train(pg, mlp, Options().sharding_strategy(ShardingStrategy::kFullShard)
                               .auto_wrap_policy(always_wrap_policy()).mixed_precision(mp), Opt::AdamW);
    expect_identical(h4.full, f.full);
    auto h2 = train(pg, mlp, hybrid(2, always_wrap_policy()).mixed_precision(mp), Opt::AdamW);
    EXPECT_GT(h2.all_reduce_bytes, 0);
    expect_close(h2.full, reference(mlp, Opt::AdamW), 2e-2);  // measured 1.54e-2
  });

  run_case("buckets", [&] {
    // bucket_cap_mb: one reduce-scatter in the shard group and one all-reduce
    // over the replica group for the whole bucket; the same sums (bit-identical:
    // the replica group has 2 ranks), the same traffic.
    for (Opt opt : {Opt::SGD, Opt::AdamW}) {
      auto off = train(pg, mlp, hybrid(2, always_wrap_policy()).bucket_cap_mb(0), opt);
      auto on = train(pg, mlp, hybrid(2, always_wrap_policy()).bucket_cap_mb(1), opt);
      expect_close(on.full, reference(mlp, opt), kParityTol);
      for (const auto& [k, v] : off.full) EXPECT_TRUE(torch::equal(on.full.at(k), v)) << k;
      EXPECT_GT(on.all_reduce_bytes, 0);
      EXPECT_EQ(on.all_reduce_bytes, off.all_reduce_bytes);
      EXPECT_EQ(on.reduce_scatter_bytes, off.reduce_scatter_bytes);
    }
    auto tf_off = train(pg, tf, hybrid(2, size_based_policy(100)).bucket_cap_mb(0), Opt::AdamW);
    auto tf_on = train(pg, tf, hybrid(2, size_based_policy(100)).bucket_cap_mb(25), Opt::AdamW);
    expect_close(tf_on.full, reference(tf, Opt::AdamW), kParityTol);
    for (const auto& [k, v] : tf_off.full) EXPECT_TRUE(torch::equal(tf_on.full.at(k), v)) << k;
  });

  run_case("replica-all-reduce-overlaps-backward", [&] {
    // MLP units reduce in the order 4, 2, 0. The replica all-reduce of unit 4
    // starts once 4's reduce-scatter is complete (at the latest when unit 2's
    // reduction needs the slot) and is waited for only at the end of backward:
    // unit 0's whole backward runs while it is in flight. (A blocking replica
    // all-reduce would end before backward 0 begins.)
    auto spans_of = [&](double cap) {
      auto model = FullyShardedDataParallel(make_mlp(), pg, hybrid(2, always_wrap_policy()).bucket_cap_mb(cap)
                                                                .trace_dir(worker_scratch_dir() + "/trace"));
      return second_step_spans(model, pg);
    };
    const auto find = find_span;
    auto t = spans_of(0);
    // Each collective span names the transport that moved it: the four ranks share this
    // host, so the shard groups and the replica groups run on shared memory, unless
    // FSDP_SHARED_MEMORY=0 (the ctest entry test_hybrid_shard_gloo) sends all through Gloo.
    const char* shm_env = std::getenv("FSDP_SHARED_MEMORY");
    const std::string want = shm_env && std::string(shm_env) == "0" ? "gloo" : "shm";
    int collectives = 0;
    for (const auto& s : t) {
      if (s.tid == Tracer::kCompute || s.tid == Tracer::kPhase) {
        EXPECT_EQ(s.transport, "") << s.name;
      } else {
        EXPECT_EQ(s.transport, want) << s.name;
        ++collectives;
      }
    }
    EXPECT_GT(collectives, 0);
    const auto rep = find(t, "replica_all_reduce 4");
    const auto bwd = find(t, "backward 0");
    EXPECT_LT(rep.begin_seq, bwd.begin_seq);
    EXPECT_GT(rep.end_seq, bwd.end_seq);
    EXPECT_GT(rep.begin_seq, find(t, "reduce 4").end_seq);  // after the shard group's sum
    // One bucket: one reduce-scatter and one replica all-reduce in all.
    auto b = spans_of(1);
    int reduces = 0, replicas = 0;
    for (const auto& s : b) {
      reduces += s.name.rfind("reduce ", 0) == 0;
      replicas += s.name.rfind("replica_all_reduce ", 0) == 0;
    }
    EXPECT_EQ(reduces, 1);
    EXPECT_EQ(replicas, 1);
    find(b, "reduce 4+2+0");
    find(b, "replica_all_reduce 4+2+0");
  });

  run_case("replica-all-reduce-starts-before-next-unit", [&] {
    // [Note: replica chain]: a unit's replica all-reduce starts once its reduce-scatter
    // is complete, not when the next unit's reduction is issued. Units reduce in the
    // order 5, 3, 0; between unit 3's reduction and unit 0's backward sits a layer whose
    // backward sleeps 300 ms (no parameters, so no unit of its own). Unit 3's replica
    // all-reduce must begin during that sleep, before unit 0's backward begins. Without
    // the chain it began only when unit 0's reduction was issued, after its backward.
    auto make = [] {
      torch::manual_seed(0);
      return torch::nn::Sequential(torch::nn::Linear(13, 32), torch::nn::Functional(slow_backward_identity),
                                   torch::nn::ReLU(), torch::nn::Linear(32, 17), torch::nn::ReLU(),
                                   torch::nn::Linear(17, 5));
    };
    auto model = FullyShardedDataParallel(make(), pg, hybrid(2, always_wrap_policy()).bucket_cap_mb(0)
                                                          .trace_dir(worker_scratch_dir() + "/trace_chain"));
    const std::vector<TraceSpan> spans = second_step_spans(model, pg);
    auto find = [&](const std::string& name) { return find_span(spans, name); };
    const auto rep = find("replica_all_reduce 3");
    EXPECT_GT(rep.begin_seq, find("reduce 3").end_seq);  // after the shard group's sum
    EXPECT_LT(rep.begin_seq, find("backward 0").begin_seq)
        << "unit 3's replica all-reduce began " << (rep.begin_us - find("backward 0").begin_us)
        << " us after unit 0's backward";
    // And the results are the single-process ones (the chain changes when, not what).
    auto ref = make();
    torch::optim::SGD ro(ref->parameters(), 0.05);
    for (int s = 0; s < 2; ++s) {
      auto [x, y] = global_batch(s, 16);
      ro.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(ref->forward(x), y).backward();
      ro.step();
    }
    std::map<std::string, torch::Tensor> want;
    for (const auto& p : ref->named_parameters()) want[p.key()] = p.value().detach().clone();
    expect_close(full_params(model), want, kParityTol);
  });

  run_case("bad-shard-group-size", [&] {
    EXPECT_THROW(FullyShardedDataParallel(make_mlp(), pg, hybrid(3, always_wrap_policy())), c10::Error);
  });
}

}  // namespace

TEST(HybridShard, FourRanksShardGroupsOfTwo) { run_ranks(4, hybrid_cases); }
