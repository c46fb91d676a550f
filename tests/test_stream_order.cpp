// The stream order ([Note: stream order] in src/core/stream_order.h) on the CPU, with
// FakeStreams: (a) the state machine alone: every hazard planted is reported, naming the
// stream, the buffer and the missing wait, and correct sequences pass; (b) FSDP training
// with the fake streams switched on, at 1-3 ranks, FULL_SHARD, SHARD_GRAD_OP, NO_SHARD,
// HYBRID_SHARD, the prefetch settings, limit_all_gathers, buckets, bf16, no_sync, the
// optimizer inside backward and activation checkpointing: no hazard, the waits counted are one per gather and per
// reduction (from the trace), and the results are bitwise equal to the same training
// without the stream order; (c) a wait left out of the runtime makes that training fail
// with the hazard it causes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>

#include "core/cuda_streams.h"
#include "core/fake_streams.h"
#include "core/stream_order.h"
#include "core/stream_order_testing.h"
#include "fsdp/autograd/checkpoint_wrapper.h"
#include "harness/bit_equal.h"
#include "harness/error_of.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/trained_state.h"

using namespace fsdp;
using namespace fsdp::testing;
using fsdp::core::detail::FakeStreams;
using fsdp::core::detail::StreamKind;
using fsdp::core::detail::StreamOrder;
using fsdp::core::detail::WaitSite;

namespace {

constexpr StreamKind kCompute = StreamKind::kCompute;
constexpr StreamKind kGather = StreamKind::kAllGather;
constexpr StreamKind kReduce = StreamKind::kReduceScatter;

// The message of the c10::Error `fn` throws ("" when it throws none).
void expect_contains(const std::string& msg, const std::string& part) {
  EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
}

struct Machine {
  std::shared_ptr<FakeStreams> fake = std::make_shared<FakeStreams>();
  StreamOrder order;
  at::Tensor block = at::empty({16});   // stands for a pool block
  at::Tensor grad = at::empty({16});    // a flat gradient
  at::Tensor shard = at::empty({8});    // a reduced shard
  Machine() { order.set_backend(fake); }

  // A unit's gather as the runtime makes it: all-gather waits compute, writes the block.
  void gather(const std::string& unit, bool gather_waits_compute = true) {
    if (gather_waits_compute)
      order.wait(WaitSite::kGatherWaitsCompute, kGather, order.record(kCompute, "issue of " + unit));
    order.acquire(kGather, block, "unsharded flat parameter", unit);
    order.write(kGather, block);
  }
  void compute_uses(bool compute_waits_gather = true) {
    if (compute_waits_gather) order.wait_written(WaitSite::kComputeWaitsGather, kCompute, block);
    order.read(kCompute, block);
  }
};

// ---- (a) the state machine ----

TEST(StreamOrderMachine, CorrectSequencesPass) {
  Machine m;
  // Two units share one pool block in turn, then a reduction.
  m.gather("l1");
  m.compute_uses();
  m.order.release(kCompute, m.block);
  m.gather("l2");  // the block reused: the all-gather waited behind its last consumer
  m.compute_uses();
  m.order.release(kCompute, m.block);
  m.order.acquire(kCompute, m.grad, "flat gradient", "l2");
  m.order.write(kCompute, m.grad);
  m.order.wait_written(WaitSite::kReduceWaitsCompute, kReduce, m.grad);
  m.order.read(kReduce, m.grad);
  m.order.acquire(kReduce, m.shard, "reduced shard", "l2", /*fresh=*/true);
  m.order.write(kReduce, m.shard);
  m.order.wait_written(WaitSite::kComputeWaitsReduce, kCompute, m.shard);
  m.order.release(kCompute, m.grad);
  m.order.read(kCompute, m.shard);
  EXPECT_EQ(m.fake->waits(kCompute, kGather), 2);
  EXPECT_EQ(m.fake->waits(kGather, kCompute), 2);
  EXPECT_EQ(m.fake->waits(kReduce, kCompute), 1);
  EXPECT_EQ(m.fake->waits(kCompute, kReduce), 1);
  EXPECT_EQ(m.fake->waits(kReduce, kGather), 0);
  EXPECT_GT(m.fake->checks(), 10);
}

TEST(StreamOrderMachine, ReadBeforeTheProducersEventIsReported) {
  Machine m;
  m.gather("layers.1");
  const std::string msg = error_of([&] { m.compute_uses(/*compute_waits_gather=*/false); });
  expect_contains(msg, "read without waiting for its producer");
  expect_contains(msg, "the compute stream would read the unsharded flat parameter of 'layers.1'");
  expect_contains(msg, "the all-gather stream recorded behind the write of the unsharded flat parameter");
  expect_contains(msg, "Missing wait: compute waits all-gather");
}

TEST(StreamOrderMachine, PoolReuseBeforeTheLastConsumersEventIsReported) {
  Machine m;
  m.gather("l1");
  m.compute_uses();
  m.order.release(kCompute, m.block);
  const std::string msg = error_of([&] { m.gather("l2", /*gather_waits_compute=*/false); });
  expect_contains(msg, "pool block reused before its next user waited on the event behind its last consumer");
  expect_contains(msg, "the all-gather stream would reuse the pool block of the unsharded flat parameter of 'l1'");
  expect_contains(msg, "Missing wait: all-gather waits compute");
}

TEST(StreamOrderMachine, FreeWhileAnotherStreamMayUseItIsReported) {
  Machine m;
  m.order.acquire(kCompute, m.grad, "flat gradient", "l3");
  m.order.write(kCompute, m.grad);
  m.order.wait_written(WaitSite::kReduceWaitsCompute, kReduce, m.grad);
  m.order.read(kReduce, m.grad);
  // Compute frees the input without waiting for the reduction that reads it.
  const std::string msg = error_of([&] { m.order.release(kCompute, m.grad); });
  expect_contains(msg, "freed while a stream may still use it");
  expect_contains(msg, "the compute stream would free the flat gradient of 'l3'");
  expect_contains(msg, "the reduce-scatter stream recorded behind a read of the flat gradient");
}

TEST(StreamOrderMachine, OverwriteBeforeTheReadersAreDoneIsReported) {
  Machine m;
  m.gather("l1");
  m.compute_uses();
  // A second gather into the same live buffer, without waiting for compute's read.
  const std::string msg = error_of([&] { m.order.write(kGather, m.block); });
  expect_contains(msg, "overwritten without waiting for its last users");
  expect_contains(msg, "the all-gather stream would write the unsharded flat parameter of 'l1'");
}

TEST(StreamOrderMachine, FirstWriteOnAnotherStreamThanTheAllocatingOneIsReported) {
  Machine m;
  m.order.acquire(kCompute, m.block, "unsharded flat parameter", "l1");
  const std::string msg = error_of([&] { m.order.write(kGather, m.block); });
  expect_contains(msg, "first written by a stream it was not allocated on");
  expect_contains(msg, "acquired for the compute stream but is first written by the all-gather stream");
}

TEST(StreamOrderMachine, OrderIsTransitiveAndEventsDoNotCoverLaterWork) {
  Machine m;
  m.order.acquire(kCompute, m.grad, "flat gradient", "l1");
  m.order.write(kCompute, m.grad);
  // compute -> all-gather -> reduce-scatter: the reduction is ordered after the write.
  m.order.wait(WaitSite::kGatherWaitsCompute, kGather, m.order.record(kCompute, "a"));
  m.order.wait(WaitSite::kGatherWaitsCompute, kReduce, m.order.record(kGather, "b"));
  EXPECT_EQ(error_of([&] { m.order.read(kReduce, m.grad); }), "");
  // An event recorded before compute's second write does not cover it.
  const auto early = m.order.record(kCompute, "before the second write");
  m.order.wait(WaitSite::kReduceWaitsCompute, kReduce, early);
  const std::string overwrite = error_of([&] { m.order.write(kCompute, m.grad); });
  expect_contains(overwrite, "overwritten without waiting for its last users");  // the reduction still reads
  m.order.wait(WaitSite::kComputeWaitsReduce, kCompute, m.order.record(kReduce, "c"));
  m.order.write(kCompute, m.grad);
  m.order.wait(WaitSite::kReduceWaitsCompute, kReduce, early);
  expect_contains(error_of([&] { m.order.read(kReduce, m.grad); }), "read without waiting for its producer");
}

TEST(StreamOrderMachine, SkippedWaitSiteIsNotMade) {
  Machine m;
  m.order.set_skipped_wait(WaitSite::kComputeWaitsGather);
  m.gather("l1");
  expect_contains(error_of([&] { m.compute_uses(); }), "read without waiting for its producer");
  EXPECT_EQ(m.fake->waits(kCompute, kGather), 0);
  EXPECT_EQ(m.fake->waits(kGather, kCompute), 1);  // the other sites still wait
}

TEST(StreamOrderMachine, OffDoesNothing) {
  StreamOrder order;  // no backend: plain CPU training
  EXPECT_FALSE(order.enabled());
  at::Tensor t = at::empty({4});
  order.read(kCompute, t);  // never acquired: nothing is looked up
  order.release(kCompute, t);
  order.wait_written(WaitSite::kComputeWaitsGather, kCompute, t);
  EXPECT_EQ(order.record(kCompute, "x").impl, nullptr);
}

// A gpu case of its own (test_stream_order_cuda): the CUDA backend records and waits real
// events on its streams. It compiles wherever libtorch has CUDA and runs on a GPU machine.
TEST(StreamOrderCuda, RecordsAndWaitsOnDeviceStreams) {
  FSDP_SKIP_WITHOUT_GPU(1);
  ASSERT_TRUE(fsdp::core::detail::cuda_streams_built()) << "a CUDA device, but fsdp-cpp was built without CUDA";
  StreamOrder order;
  order.set_backend(fsdp::core::detail::make_cuda_streams(0));
  at::Tensor block = at::empty({1 << 20}, at::TensorOptions().device(at::kCUDA));
  order.wait(WaitSite::kGatherWaitsCompute, kGather, order.record(kCompute, "issue"));
  order.acquire(kGather, block, "unsharded flat parameter", "l1");
  order.write(kGather, block);
  order.wait_written(WaitSite::kComputeWaitsGather, kCompute, block);
  order.read(kCompute, block);
  order.release(kCompute, block);
  torch::cuda::synchronize();
}

// ---- (b) FSDP training with the fake streams ----

enum class Extra { None, Bf16, OptimizerInBackward, Checkpoint, NoSync };

struct Config {
  std::string name;
  Options options;
  Extra extra = Extra::None;
};

std::vector<Config> configs(int world) {
  auto base = [](ShardingStrategy s) {
    return Options().sharding_strategy(s).auto_wrap_policy(module_type_policy<BlockImpl>());
  };
  const auto FULL = ShardingStrategy::kFullShard;
  std::vector<Config> c;
  c.push_back({"FULL_SHARD", base(FULL)});
  c.push_back({"FULL_SHARD/forward-prefetch/unlimited",
               base(FULL).forward_prefetch(true).limit_all_gathers(false)});
  c.push_back({"FULL_SHARD/BACKWARD_POST", base(FULL).backward_prefetch(BackwardPrefetch::kBackwardPost)});
  c.push_back({"FULL_SHARD/no-prefetch", base(FULL).backward_prefetch(BackwardPrefetch::kNone)});
  c.push_back({"FULL_SHARD/buckets", base(FULL).bucket_cap_mb(1)});
  c.push_back({"SHARD_GRAD_OP", base(ShardingStrategy::kShardGradOp)});
  c.push_back({"NO_SHARD", base(ShardingStrategy::kNoShard)});
  c.push_back({"FULL_SHARD/bf16", base(FULL), Extra::Bf16});
  c.push_back({"NO_SHARD/bf16", base(ShardingStrategy::kNoShard), Extra::Bf16});
  c.push_back({"FULL_SHARD/optimizer-in-backward", base(FULL), Extra::OptimizerInBackward});
  c.push_back({"SHARD_GRAD_OP/optimizer-in-backward", base(ShardingStrategy::kShardGradOp),
               Extra::OptimizerInBackward});
  c.push_back({"FULL_SHARD/checkpoint", base(FULL), Extra::Checkpoint});
  c.push_back({"SHARD_GRAD_OP/checkpoint", base(ShardingStrategy::kShardGradOp), Extra::Checkpoint});
  c.push_back({"FULL_SHARD/no_sync", base(FULL), Extra::NoSync});
  // Replicated across every rank: the chain's replica all-reduce after each reduction.
  if (world > 1) c.push_back({"HYBRID_SHARD/replicas", base(ShardingStrategy::kHybridShard).shard_group_size(1)});
  for (auto& x : c) {
    if (x.extra == Extra::Bf16) x.options.mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16));
    if (x.extra == Extra::OptimizerInBackward) x.options.optimizer_in_backward(true);
  }
  return c;
}

struct Run : TrainedState {
  int64_t gathers = 0, reductions = 0;  // spans in the trace
};

// The fake streams, switched on for the runtimes built while this lives.
class FakeStreamsScope {
 public:
  FakeStreamsScope(std::shared_ptr<FakeStreams> fake, std::optional<WaitSite> skipped = std::nullopt) {
    fsdp::core::detail::StreamOrderTestHooks hooks;
    if (fake) hooks.make_backend = [fake] { return fake; };
    hooks.skipped_wait = skipped;
    fsdp::core::detail::set_stream_order_test_hooks(hooks);
  }
  ~FakeStreamsScope() { fsdp::core::detail::set_stream_order_test_hooks({}); }
};

Run train(comm::ProcessGroup& pg, const Config& c, std::shared_ptr<FakeStreams> fake,
          std::optional<WaitSite> skipped = std::nullopt, int steps = 3) {
  torch::manual_seed(0);
  TinyTransformer net(13, 24, 5, 3);
  if (c.extra == Extra::Checkpoint) {
    EXPECT_EQ(apply_activation_checkpointing(*net, checkpoint_module_type<BlockImpl>()), 3);
  }
  std::optional<FullyShardedDataParallel<TinyTransformerImpl>> model;
  {
    FakeStreamsScope scope(fake, skipped);
    model.emplace(net, pg, Options(c.options).trace_dir(worker_scratch_dir() + "/trace"));
  }
  auto& m = *model;
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  if (c.extra == Extra::OptimizerInBackward) m->register_optimizer_in_backward(opt);
  Run run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad(/*set_to_none=*/true);
    // NoSync: a first micro-batch accumulates without reducing.
    for (int k = c.extra == Extra::NoSync ? 0 : 1; k < 2; ++k) {
      std::optional<FullyShardedBase::NoSyncGuard> no_sync;
      if (k == 0) no_sync.emplace(m->no_sync());
      auto [x, y] = global_batch(2 * s + k, 12);
      auto out = m->forward(rank_slice(x, pg.rank(), pg.size())).to(torch::kFloat);
      torch::mse_loss(out, rank_slice(y, pg.rank(), pg.size())).backward();
    }
    std::vector<torch::Tensor> g;
    for (auto& p : m->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    run.grads.push_back(std::move(g));
    opt.step();
  }
  for (auto& p : m->parameters()) run.params.push_back(p.detach().clone());
  for (const auto& span : m->trace_spans()) {
    if (span.name.rfind("all_gather ", 0) == 0) ++run.gathers;
    if (span.name.rfind("reduce ", 0) == 0) ++run.reductions;
  }
  return run;
}

void training_cases(comm::ProcessGroup& pg) {
  for (const Config& c : configs(pg.size())) {
    run_case(c.name, [&] {
      const Run ref = train(pg, c, nullptr);
      auto fake = std::make_shared<FakeStreams>();
      Run run;
      const std::string hazard = error_of([&] { run = train(pg, c, fake); });
      ASSERT_EQ(hazard, "") << "a stream-order hazard in correct training";
      expect_bitwise_equal(run, ref);
      EXPECT_EQ(run.gathers, ref.gathers);
      EXPECT_EQ(run.reductions, ref.reductions);
      // One wait each way per all-gather, and per reduction.
      EXPECT_EQ(fake->waits(kCompute, kGather), run.gathers);
      EXPECT_EQ(fake->waits(kGather, kCompute), run.gathers);
      EXPECT_EQ(fake->waits(kReduce, kCompute), run.reductions);
      // HYBRID_SHARD: compute waits after the scatter (to free the input) and after the
      // replica all-reduce (to read the shard).
      const bool replicas = c.options.sharding_strategy() == ShardingStrategy::kHybridShard;
      EXPECT_EQ(fake->waits(kCompute, kReduce), (replicas ? 2 : 1) * run.reductions);
      EXPECT_EQ(fake->waits(kGather, kReduce) + fake->waits(kReduce, kGather), 0);
      EXPECT_GT(run.reductions, 0);
      const bool gathers = c.options.sharding_strategy() == ShardingStrategy::kFullShard ||
                           c.options.sharding_strategy() == ShardingStrategy::kShardGradOp;
      EXPECT_EQ(run.gathers > 0, gathers);
      EXPECT_GT(fake->checks(), 0);
    });
  }
}

TEST(FsdpFakeStreams, TrainsWithoutHazardsAt1Rank) { run_ranks(1, training_cases); }
TEST(FsdpFakeStreams, TrainsWithoutHazardsAt2Ranks) { run_ranks(2, training_cases); }
TEST(FsdpFakeStreams, TrainsWithoutHazardsAt3Ranks) { run_ranks(3, training_cases); }

// ---- (d) on a GPU: the CUDA stream order, with delays injected on one stream ----
//
// A gpu case of its own (test_stream_order_cuda). FSDP on the rank's GPU orders its
// all-gather and reduce-scatter streams through the CUDA backend. A spin kernel queued
// before each collective's issue makes one side late: on the all-gather or reduce-scatter
// stream the collectives run late (a consumer that does not wait reads too early); on
// compute the work the collectives must wait for runs late (a cast, a flattened gradient,
// the last reads of a pool block the next gather overwrites). Each delayed run must equal
// the undelayed one bit for bit (same kernels, same order).
//
// What the negative controls show (at one rank, over NCCL, whose collectives run on a
// stream of their own):
// - The producer-side waits are live: only the stream order makes the all-gather stream
//   wait compute (GatherWaitsCompute) and the reduce-scatter stream wait the flattening
//   (ReduceWaitsCompute); with compute late, leaving either out changes the values.
// - The consumer-side wait is covered twice: the collective's handle, waited with compute
//   current, orders compute after NCCL's stream by itself, so ComputeWaitsGather alone
//   cannot be shown missing. With the handle's wait moved to a stream compute never waits,
//   the stream order alone keeps the values; leaving out ComputeWaitsGather as well, so
//   that nothing orders compute after the late all-gather, changes them.
// Each control repeats kRepeats times: a planted skip must change the values every time,
// and the correct run under the same delay must match every time.

class StreamHooksScope {
 public:
  explicit StreamHooksScope(fsdp::core::detail::StreamOrderTestHooks hooks) {
    fsdp::core::detail::set_stream_order_test_hooks(std::move(hooks));
  }
  ~StreamHooksScope() { fsdp::core::detail::set_stream_order_test_hooks({}); }
};

constexpr int64_t kDelayCycles = 20'000'000;  // ~10 ms at H100 clocks: longer than any unit's compute
constexpr int kRepeats = 3;

TrainedState train_on_gpu(comm::ProcessGroup& pg, const Config& c, fsdp::core::detail::StreamOrderTestHooks hooks,
                          int steps = 3) {
  const torch::Device gpu(torch::kCUDA, pg.cuda_device());
  torch::manual_seed(0);
  TinyTransformer net(13, 24, 5, 3);
  net->to(gpu);
  std::optional<FullyShardedDataParallel<TinyTransformerImpl>> model;
  {
    StreamHooksScope scope(std::move(hooks));
    model.emplace(net, pg, c.options);
  }
  auto& m = *model;
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  if (c.extra == Extra::OptimizerInBackward) m->register_optimizer_in_backward(opt);
  TrainedState run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad(/*set_to_none=*/true);
    auto [x, y] = global_batch(s, 12);
    auto out = m->forward(rank_slice(x, pg.rank(), pg.size()).to(gpu)).to(torch::kFloat);
    torch::mse_loss(out, rank_slice(y, pg.rank(), pg.size()).to(gpu)).backward();
    std::vector<torch::Tensor> g;
    for (auto& p : m->parameters()) g.push_back(p.grad().defined() ? p.grad().cpu() : torch::Tensor());
    run.grads.push_back(std::move(g));
    opt.step();
  }
  for (auto& p : m->parameters()) run.params.push_back(p.detach().cpu());
  return run;
}

fsdp::core::detail::StreamOrderTestHooks delayed(StreamKind stream) {
  fsdp::core::detail::StreamOrderTestHooks hooks;
  hooks.delayed_stream = stream;
  hooks.delay_cycles = kDelayCycles;
  return hooks;
}

// How many of kRepeats runs under `hooks` end with the parameters of `ref`.
int runs_matching(comm::ProcessGroup& pg, const Config& c, const fsdp::core::detail::StreamOrderTestHooks& hooks,
                  const TrainedState& ref) {
  int matching = 0;
  for (int i = 0; i < kRepeats; ++i) matching += bit_equal(train_on_gpu(pg, c, hooks).params, ref.params) ? 1 : 0;
  return matching;
}

void negative_controls(comm::ProcessGroup& pg) {
  const Config full{"FULL_SHARD", Options().auto_wrap_policy(module_type_policy<BlockImpl>())};
  const TrainedState ref = train_on_gpu(pg, full, {});
  run_case("compute late: the correct run keeps the values", [&] {
    EXPECT_EQ(runs_matching(pg, full, delayed(kCompute), ref), kRepeats);
  });
  for (WaitSite producer_side : {WaitSite::kGatherWaitsCompute, WaitSite::kReduceWaitsCompute}) {
    run_case(std::string("compute late, planted: ") + fsdp::core::detail::to_string(producer_side), [&] {
      auto hooks = delayed(kCompute);
      hooks.skipped_wait = producer_side;
      EXPECT_EQ(runs_matching(pg, full, hooks, ref), 0)
          << "a collective read or overwrote memory before compute's late work on it, and the values stayed "
             "the same: the compute-side delay did not make that work late";
    });
  }
  run_case("all-gather late, handle waited off compute: the stream order alone keeps the values", [&] {
    auto hooks = delayed(kGather);
    hooks.gather_handle_wait_off_compute = true;
    EXPECT_EQ(runs_matching(pg, full, hooks, ref), kRepeats);
  });
  run_case("all-gather late, handle waited off compute, planted: compute waits all-gather", [&] {
    auto hooks = delayed(kGather);
    hooks.gather_handle_wait_off_compute = true;
    hooks.skipped_wait = WaitSite::kComputeWaitsGather;
    EXPECT_EQ(runs_matching(pg, full, hooks, ref), 0)
        << "compute read the gathered parameters with nothing ordering it after the late all-gather, and "
           "still got the same values: the delay did not reach the all-gather";
  });
}

void delayed_stream_cases(comm::ProcessGroup& pg) {
  for (const Config& c : configs(pg.size())) {
    if (c.extra == Extra::Checkpoint || c.extra == Extra::NoSync) continue;  // their CPU cases cover the order
    run_case(c.name, [&] {
      const TrainedState ref = train_on_gpu(pg, c, {});
      for (StreamKind late : {kGather, kReduce, kCompute}) {
        SCOPED_TRACE(std::string("delayed: ") + fsdp::core::detail::to_string(late));
        expect_bitwise_equal(train_on_gpu(pg, c, delayed(late)), ref);
      }
    });
  }
  if (pg.size() == 1) negative_controls(pg);
}

TEST(FsdpCudaStreams, DelayedStreamsKeepParityAt1RankNccl) {
  FSDP_SKIP_WITHOUT_GPU(1);
  RankOptions o;
  o.backend = comm::Backend::kNccl;
  run_ranks(1, delayed_stream_cases, o);
}

TEST(FsdpCudaStreams, DelayedStreamsKeepParityAt2RanksGlooOnOneGpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  RankOptions o;
  o.backend = comm::Backend::kGloo;
  run_ranks(2, delayed_stream_cases, o);
}

// ---- (c) a wait left out of the runtime ----

TEST(FsdpFakeStreams, PlantedMissingWaitIsReported) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    struct Planted {
      WaitSite site;
      std::vector<std::string> expected;
    };
    const std::vector<Planted> planted = {
        {WaitSite::kComputeWaitsGather,
         {"read without waiting for its producer", "the compute stream would read the unsharded flat parameter"}},
        {WaitSite::kGatherWaitsCompute,
         {"pool block reused before its next user waited", "the all-gather stream would reuse the pool block"}},
        {WaitSite::kReduceWaitsCompute,
         {"read without waiting for its producer", "the reduce-scatter stream would read the flat gradient"}},
        {WaitSite::kComputeWaitsReduce,
         {"freed while a stream may still use it", "the compute stream would free the flat gradient"}},
    };
    const Config full{"FULL_SHARD", Options().auto_wrap_policy(module_type_policy<BlockImpl>())};
    for (const Planted& p : planted) {
      run_case(fsdp::core::detail::to_string(p.site), [&] {
        const std::string msg = error_of([&] { train(pg, full, std::make_shared<FakeStreams>(), p.site); });
        for (const auto& part : p.expected) expect_contains(msg, part);
        expect_contains(msg, "fsdp stream-order hazard");
      });
    }
  });
}

}  // namespace
