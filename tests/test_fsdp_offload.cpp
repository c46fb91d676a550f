// Options::cpu_offload ([Note: offload] in src/core/flat_param.h): shards, reduced gradient
// pieces and optimizer state in host memory, only compute-dtype copies on the model's device.
//
// On this CPU-only machine host and device are one memory, so the offloaded run must equal the
// same training without offload bit for bit (the reference: a second model, same options but the
// flag), while the offload path itself runs: a device copy of every shard before its gather (also
// under NO_SHARD, where the shard would otherwise be the unsharded buffer), a host copy of every
// reduced gradient shard, and the accounting (MemoryStats::offloaded_bytes, closed form). Cases:
// every strategy at 1-3 ranks, Adam and CPUAdam, stepping after backward and inside it
// (optimizer_in_backward), bf16 mixed precision, buckets, accumulation under no_sync; checkpoints
// saved with offload resume without it and the other way round; the refusals (ranks that
// disagree on the placement, shards made at construction); an out-of-memory error naming the unit.
// FsdpOffloadCuda (ctest label gpu, skips without a GPU): a model on the rank's GPU keeps no fp32
// parameter bytes there after wrapping, its parameters are pinned host tensors, and CPUAdam on the
// host trains it like Adam on the GPU without offload within a stated tolerance; the same for
// ZeRO-2 with ZeroOptions::cpu_offload (its masters pinned on the host, no optimizer state on the GPU).
// ZeRO's CPU cases are in test_zero_optimizer and test_fsdp_optimizer_in_backward. And about 1B
// parameters under a 12 GiB cap (setMemoryFraction): out of memory, naming the unit, without
// offload; trains with it.
#include <c10/core/CachingDeviceAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "core/counting_allocator.h"
#include "fsdp/core/sharded_init.h"
#include "fsdp/memory/optimizer_state_bytes.h"
#include "fsdp/optim/cpu_adam.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/checkpoint.h"
#include "harness/device_memory_probe.h"
#include "harness/error_of.h"
#include "harness/gpu.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/same_params.h"

// White-box: the inner optimizer's state by parameter; a GPU memory cap.
#include "memory/device_memory.h"
#include "memory/param_state_key.h"
#include "state/optim_state.h"

using namespace fsdp;
using namespace fsdp::testing;
using fsdp::memory::CountingAllocator;
using fsdp::memory::install_counting_allocator;

namespace {

constexpr int64_t kBatch = 12;  // divides among 1, 2 and 3 ranks

struct Case {
  std::string name;
  Options options;
  bool cpu_adam = false;
  bool in_backward = false;
  int micro_batches = 1;  // accumulated under no_sync
  int steps = 4;
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(bool cpu_adam, torch::nn::Module& m) {
  if (cpu_adam) return std::make_unique<optim::CPUAdam>(m.parameters(), optim::CPUAdamOptions(1e-2).weight_decay(0.01));
  return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(1e-2).weight_decay(0.01));
}

// One optimizer step of the wrapped model `m` on the rank's slice of global step `step`'s batch.
template <typename Wrapped>
void train_step(comm::ProcessGroup& pg, Wrapped& m, torch::optim::Optimizer& opt, int64_t step, int micro_batches = 1) {
  opt.zero_grad(/*set_to_none=*/true);
  for (int k = 0; k < micro_batches; ++k) {
    std::optional<FullyShardedBase::NoSyncGuard> no_sync;
    if (k + 1 < micro_batches) no_sync.emplace(m->no_sync());
    auto [x, y] = global_batch(step * micro_batches + k, kBatch);
    auto out = m->forward(rank_slice(x, pg.rank(), pg.size())).to(torch::kFloat);
    (torch::mse_loss(out, rank_slice(y, pg.rank(), pg.size())) / double(micro_batches)).backward();
  }
  // Stepped inside backward (on the host thread, [Note: host steps]): nothing left to step.
  if (m->options().optimizer_in_backward()) {
    for (const auto& p : m->named_parameters()) EXPECT_FALSE(p.value().grad().defined()) << p.key() << " not stepped in backward";
  }
  opt.step();  // a no-op after a backward that stepped
}

template <typename ModelFactory>
void check_equal_to_no_offload(comm::ProcessGroup& pg, const Case& c, ModelFactory make) {
  run_case(c.name, [&] {
    const Options base = Options(c.options).optimizer_in_backward(c.in_backward);
    auto ref = FullyShardedDataParallel(make(), pg, Options(base).cpu_offload(false));
    auto model = FullyShardedDataParallel(make(), pg, Options(base).cpu_offload(true));
    auto ref_opt = make_optimizer(c.cpu_adam, *ref);
    auto opt = make_optimizer(c.cpu_adam, *model);
    if (c.in_backward) {
      ref->register_optimizer_in_backward(*ref_opt);
      model->register_optimizer_in_backward(*opt);
    }
    for (int s = 0; s < c.steps; ++s) {
      ref->reset_peak_memory_stats();
      train_step(pg, ref, *ref_opt, s, c.micro_batches);
      model->reset_peak_memory_stats();
      train_step(pg, model, *opt, s, c.micro_batches);
      expect_same_params(*model, *ref, "step " + std::to_string(s));
    }
    // The accounting: every shard and gradient piece is host memory with offload, none without.
    const MemoryStats with = model->memory_stats(), without = ref->memory_stats();
    EXPECT_EQ(with.offloaded_bytes, with.param_shard_bytes + with.grad_shard_bytes);
    EXPECT_EQ(with.param_shard_bytes, without.param_shard_bytes);
    EXPECT_GT(with.offloaded_bytes, 0);
    EXPECT_EQ(without.offloaded_bytes, 0);
    // The device copies ran. Where the run without offload computes in the shard itself
    // (unsharded units in full precision: NO_SHARD, a HYBRID_SHARD group of one rank) the
    // offloaded run holds a device copy of each unit besides: more transient bytes at the peak.
    // Elsewhere both gather into the same buffers.
    const auto strategy = c.options.sharding_strategy();
    const bool unsharded = strategy == ShardingStrategy::kNoShard ||
                           (strategy == ShardingStrategy::kHybridShard && c.options.shard_group_size() == 1);
    const bool shard_is_compute_buffer = unsharded && !c.options.mixed_precision().param_dtype();
    if (shard_is_compute_buffer) {
      EXPECT_GT(with.unsharded_peak_bytes, without.unsharded_peak_bytes) << "no device copy of the shards was made";
    } else {
      EXPECT_EQ(with.unsharded_peak_bytes, without.unsharded_peak_bytes);
    }
  });
}

void equality_cases(comm::ProcessGroup& pg) {
  const int n = pg.size();
  using S = ShardingStrategy;
  auto strategy = [](S s) { return Options().sharding_strategy(s); };
  const auto each = always_wrap_policy();
  const auto blocks = size_based_policy(100);
  auto mlp = [] { return make_mlp(); };
  auto transformer = [] { return make_transformer(); };
  const Options hybrid = strategy(S::kHybridShard).shard_group_size(n % 2 == 0 ? 2 : n);
  check_equal_to_no_offload(pg, {"mlp/full_shard/adam", strategy(S::kFullShard).auto_wrap_policy(each)}, mlp);
  check_equal_to_no_offload(pg, {"mlp/full_shard/cpu_adam/in_backward", strategy(S::kFullShard).auto_wrap_policy(each), true, true},
                            mlp);
  check_equal_to_no_offload(
      pg, {"transformer/shard_grad_op/cpu_adam", strategy(S::kShardGradOp).auto_wrap_policy(blocks), true}, transformer);
  check_equal_to_no_offload(pg, {"transformer/no_shard/adam/in_backward", strategy(S::kNoShard).auto_wrap_policy(blocks), false, true},
                            transformer);
  check_equal_to_no_offload(pg, {"transformer/hybrid_shard/cpu_adam/in_backward", Options(hybrid).auto_wrap_policy(blocks), true, true},
                            transformer);
  check_equal_to_no_offload(
      pg, {"transformer/full_shard/cpu_adam/bf16",
           strategy(S::kFullShard).auto_wrap_policy(blocks).mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16)),
           true},
      transformer);
  check_equal_to_no_offload(
      pg, {"mlp/full_shard/adam/buckets/in_backward", strategy(S::kFullShard).auto_wrap_policy(each).bucket_cap_mb(1), false, true},
      mlp);
  check_equal_to_no_offload(pg, {"mlp/full_shard/cpu_adam/no_sync x3", strategy(S::kFullShard).auto_wrap_policy(each), true, false, 3, 3},
                            mlp);
}

TEST(FsdpOffload, EqualsTrainingWithoutOffload) {
  for (int n : {1, 2, 3}) run_ranks(n, equality_cases);
}

// Placement "auto" (Options::gpu_margin_mem_ratio): a probe stands in for the GPU, with a budget of
// half the bytes the shards and their Adam state take. After the first backward the units that
// fit are back on the compute device (here another CPU allocation, so the moves must carry every
// value and state over), the rest stay offloaded, the choice does not change afterwards, and
// training equals the run without offload bit for bit.
void expect_placed_within_budget(FullyShardedBase& model, const torch::optim::Optimizer& opt, int64_t budget) {
  const auto placed = model.units_placed_on_device();
  const auto paths = model.unit_paths();
  ASSERT_GT(placed.size(), 0u) << "nothing was placed";
  const MemoryStats stats = model.memory_stats();
  EXPECT_GT(stats.offloaded_bytes, 0) << "everything was placed";
  // After a backward that stepped there are no gradient pieces: what is not offloaded is the
  // placed units' shards.
  const int64_t placed_shards = stats.param_shard_bytes - stats.offloaded_bytes;
  std::map<std::string, at::Tensor> params;
  for (const auto& p : model.named_parameters()) params[p.key()] = p.value();
  int64_t placed_state = 0;
  for (const auto& path : placed) {
    const size_t i = std::find(paths.begin(), paths.end(), path) - paths.begin();
    ASSERT_LT(i, paths.size()) << path;
    for (const auto& fqn : model.unit_parameter_names(i)) {
      if (const auto* s = memory::param_state(opt, params.at(fqn))) placed_state += memory::optimizer_state_bytes(*s);
    }
  }
  EXPECT_GT(placed_state, 0) << "the placed units' state is unknown";
  EXPECT_LE(placed_shards + placed_state, budget);
}

template <typename ModelFactory>
void check_auto_placement(comm::ProcessGroup& pg, const Case& c, ModelFactory make) {
  run_case(c.name, [&] {
    DeviceMemoryProbe probe;
    const Options base = Options(c.options).optimizer_in_backward(true);
    auto ref = FullyShardedDataParallel(make(), pg, base);
    auto model = FullyShardedDataParallel(
        make(), pg, Options(base).cpu_offload(true).gpu_margin_mem_ratio(DeviceMemoryProbe::kRatio));
    probe.budget = 3 * model->memory_stats().param_shard_bytes / 2;
    auto ref_opt = make_optimizer(c.cpu_adam, *ref);
    auto opt = make_optimizer(c.cpu_adam, *model);
    ref->register_optimizer_in_backward(*ref_opt);
    model->register_optimizer_in_backward(*opt);
    std::vector<std::string> first;
    for (int s = 0; s < c.steps; ++s) {
      train_step(pg, ref, *ref_opt, s);
      train_step(pg, model, *opt, s);
      expect_same_params(*model, *ref, "step " + std::to_string(s));
      if (s == 0) {
        expect_placed_within_budget(*model, *opt, probe.budget);
        first = model->units_placed_on_device();
      }
    }
    EXPECT_EQ(model->units_placed_on_device(), first) << "placed once, after the first backward";
  });
}

TEST(FsdpOffload, AutoPlacementMovesWhatFitsAndTrainsTheSame) {
  for (int n : {1, 2, 3}) {
    run_ranks(n, [](comm::ProcessGroup& pg) {
      using S = ShardingStrategy;
      auto mlp = [] { return make_mlp(); };
      auto transformer = [] { return make_transformer(); };
      check_auto_placement(pg, {"mlp/full_shard/adam", Options().auto_wrap_policy(always_wrap_policy())}, mlp);
      check_auto_placement(pg, {"transformer/no_shard/cpu_adam", Options().sharding_strategy(S::kNoShard)
                                    .auto_wrap_policy(always_wrap_policy()), true}, transformer);
      check_auto_placement(pg, {"transformer/shard_grad_op/cpu_adam/bf16", Options().sharding_strategy(S::kShardGradOp)
                                    .auto_wrap_policy(always_wrap_policy())
                                    .mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16)), true}, transformer);
    });
  }
}

TEST(FsdpOffload, AutoPlacementRefusals) {
  run_ranks(1, [](comm::ProcessGroup& pg) {
    const Options o = Options().auto_wrap_policy(always_wrap_policy());
    auto refusal = [&](const Options& bad) { return error_of([&] { FullyShardedDataParallel(make_mlp(), pg, bad); }); };
    const std::string range = refusal(Options(o).cpu_offload(true).optimizer_in_backward(true).gpu_margin_mem_ratio(1.5));
    EXPECT_NE(range.find("gpu_margin_mem_ratio must be in [0, 1], got 1.5"), std::string::npos) << range;
    const std::string no_offload = refusal(Options(o).optimizer_in_backward(true).gpu_margin_mem_ratio(0.5));
    EXPECT_NE(no_offload.find("cpu_offload is off; add cpu_offload(true)"), std::string::npos) << no_offload;
    const std::string no_in_backward = refusal(Options(o).cpu_offload(true).gpu_margin_mem_ratio(0.5));
    EXPECT_NE(no_in_backward.find("add optimizer_in_backward(true)"), std::string::npos) << no_in_backward;
  });
}

// A checkpoint is the same whichever side its shards were on: saved after 2 steps by one
// placement and resumed for 2 more by the other, training ends where 4 uninterrupted steps end.
TEST(FsdpOffload, CheckpointsDoNotDependOnPlacement) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const Options o = Options().auto_wrap_policy(size_based_policy(100));
    auto uninterrupted = FullyShardedDataParallel(make_transformer(), pg, o);
    auto ref_opt = make_optimizer(true, *uninterrupted);
    for (int s = 0; s < 4; ++s) train_step(pg, uninterrupted, *ref_opt, s);
    for (bool saved_offloaded : {true, false}) {
      run_case(saved_offloaded ? "offload -> device" : "device -> offload", [&] {
        const std::string dir = worker_scratch_dir() + "/ckpt";
        auto first = FullyShardedDataParallel(make_transformer(), pg, Options(o).cpu_offload(saved_offloaded));
        auto first_opt = make_optimizer(true, *first);
        for (int s = 0; s < 2; ++s) train_step(pg, first, *first_opt, s);
        save_checkpoint(dir, *first, first_opt.get());
        auto second = FullyShardedDataParallel(make_transformer(1), pg, Options(o).cpu_offload(!saved_offloaded));
        auto second_opt = make_optimizer(true, *second);
        load_checkpoint(dir, *second, second_opt.get());
        for (int s = 2; s < 4; ++s) train_step(pg, second, *second_opt, s);
        expect_same_params(*second, *uninterrupted, "after the resumed steps");
      });
    }
  });
}

TEST(FsdpOffload, RefusesShardsMadeAtConstruction) {
  run_ranks(1, [](comm::ProcessGroup& pg) {
    const Options o = Options().auto_wrap_policy(module_type_policy<BlockImpl>()).cpu_offload(true);
    const std::string e = error_of([&] { ShardedInitContext ctx(pg, o); });
    EXPECT_NE(e.find("cpu_offload cannot be given to a ShardedInitContext"), std::string::npos) << e;
    std::shared_ptr<TinyTransformerImpl> m;
    {
      ShardedInitContext ctx(pg, Options(o).cpu_offload(false));
      m = std::make_shared<TinyTransformerImpl>(13, 24, 5, 2);
    }
    const std::string w = error_of([&] { FullyShardedDataParallel(m, pg, o); });
    EXPECT_NE(w.find("cpu_offload cannot take them over"), std::string::npos) << w;
  });
}

// With optimizer_in_backward the steps run on a host thread ([Note: host steps]); one that
// fails makes backward raise its error, and the model still closes.
TEST(FsdpOffload, AHostStepsErrorIsRaisedByBackward) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    struct FailingSGD : torch::optim::SGD {
      using torch::optim::SGD::SGD;
      torch::Tensor step(LossClosure) override { TORCH_CHECK(false, "the step failed on purpose"); }
    };
    auto m = FullyShardedDataParallel(
        make_mlp(), pg, Options().auto_wrap_policy(always_wrap_policy()).cpu_offload(true).optimizer_in_backward(true));
    FailingSGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
    m->register_optimizer_in_backward(opt);
    auto [x, y] = global_batch(0, kBatch);
    const std::string e = error_of([&] {
      torch::mse_loss(m->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())).backward();
    });
    EXPECT_NE(e.find("the step failed on purpose"), std::string::npos) << e;
  });
}

// The end of backward waits for the host thread's steps; the trace shows that wait as one
// "host_steps" span on the compute track per backward (none without offload: nothing to wait for).
TEST(FsdpOffload, TheWaitForHostStepsIsTraced) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    for (bool offload : {true, false}) {
      const Options o = Options()
                            .auto_wrap_policy(always_wrap_policy())
                            .optimizer_in_backward(true)
                            .cpu_offload(offload)
                            .trace_dir(worker_scratch_dir() + "/trace");
      auto m = FullyShardedDataParallel(make_mlp(), pg, o);
      auto opt = make_optimizer(true, *m);
      m->register_optimizer_in_backward(*opt);
      for (int s = 0; s < 3; ++s) train_step(pg, m, *opt, s);
      int waits = 0;
      int64_t last_backward_begin = -1;
      for (const auto& span : m->trace_spans()) {
        if (span.name.rfind("backward ", 0) == 0) last_backward_begin = span.begin_seq;
        if (span.name != "host_steps") continue;
        ++waits;
        EXPECT_EQ(span.tid, 0);
        EXPECT_GT(span.begin_seq, last_backward_begin) << "the wait comes after the backward it ends";
      }
      EXPECT_EQ(waits, offload ? 3 : 0) << (offload ? "with" : "without") << " offload";
    }
  });
}

TEST(FsdpOffload, PlacementAgreesAcrossRanks) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const Options o = Options().auto_wrap_policy(always_wrap_policy()).cpu_offload(pg.rank() == 1);
    const std::string e = error_of([&] { FullyShardedDataParallel(make_mlp(), pg, o); });
    EXPECT_NE(e.find("fsdp: the placement differs across ranks"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 0 has 'cpu_offload(false)'"), std::string::npos) << e;
  });
}

// Out of memory while FSDP makes a unit's buffer: the error names the unit and the ways out
// (offload among them) and is still an OutOfMemoryError. A cap on the counting CPU allocator
// stands in for a full GPU: the first buffer forward needs is a unit's gathered parameters.
TEST(FsdpOffload, OutOfMemoryNamesTheUnit) {
  run_ranks(1, [](comm::ProcessGroup& pg) {
    CountingAllocator* counter = install_counting_allocator();
    auto m = FullyShardedDataParallel(make_mlp(), pg, Options().auto_wrap_policy(always_wrap_policy()));
    auto [x, y] = global_batch(0, kBatch);
    std::string message;
    counter->set_limit(counter->live() + 1);
    try {
      m->forward(x);
    } catch (const c10::OutOfMemoryError& e) {
      message = e.what_without_backtrace();
    }
    counter->set_limit(0);
    EXPECT_NE(message.find("fsdp (rank 0): out of memory gathering the parameters of unit '"), std::string::npos)
        << "not an OutOfMemoryError naming the unit: '" << message << "'";
    EXPECT_NE(message.find("Options::cpu_offload(true)"), std::string::npos) << message;
  });
}

// ---- on a GPU ----

int64_t cuda_allocated_bytes(int device) {
  // Through c10's device-generic interface: no CUDA header in this test.
  return c10::getDeviceAllocator(c10::DeviceType::CUDA)
      ->getDeviceStats(static_cast<c10::DeviceIndex>(device))
      .allocated_bytes[0]
      .current;
}

RankOptions nccl_options() {
  RankOptions ro;
  ro.backend = comm::Backend::kNccl;
  return ro;
}

// CPUAdam on the host against torch's Adam on the GPU: the same update in another order of
// float operations (fused vs. op by op), so equal to rounding: relative L2 < 1e-5 after 4 steps
// (a step skipped or taken twice, or a stale shard, is off by > 1e-2).
constexpr double kHostVsDeviceAdamTol = 1e-5;

void expect_close_params(torch::nn::Module& host_stepped, torch::nn::Module& device_stepped) {
  auto pa = host_stepped.named_parameters(), pb = device_stepped.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const auto a = pa[i].value().detach().cpu().to(torch::kDouble), b = pb[i].value().detach().cpu().to(torch::kDouble);
    const double rel = (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-30);
    EXPECT_LT(rel, kHostVsDeviceAdamTol) << pa[i].key();
  }
}

TEST(FsdpOffloadCuda, ShardsLeaveTheGpuAndTrainLikeAdamOnIt) {
  FSDP_SKIP_WITHOUT_GPU(1);
  const RankOptions ro = nccl_options();
  run_ranks(1, [](comm::ProcessGroup& pg) {
    at::globalContext().setAllowTF32CuBLAS(false);
    const torch::Device gpu(torch::kCUDA, pg.cuda_device());
    const Options o = Options().auto_wrap_policy(size_based_policy(100));
    auto on_gpu = [&] {
      auto m = make_transformer();
      m->to(gpu);
      return m;
    };
    auto ref = FullyShardedDataParallel(on_gpu(), pg, o);
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(0.01));
    torch::cuda::synchronize();
    const int64_t before = cuda_allocated_bytes(gpu.index());
    auto unwrapped = on_gpu();
    int64_t param_bytes = 0;
    for (const auto& p : unwrapped->parameters()) param_bytes += p.numel() * p.element_size();
    auto model = FullyShardedDataParallel(unwrapped, pg, Options(o).cpu_offload(true).optimizer_in_backward(true));
    torch::cuda::synchronize();
    // No fp32 parameter bytes stay on the GPU: only buffers (none in this model) would.
    EXPECT_LE(cuda_allocated_bytes(gpu.index()) - before, 0) << "of " << param_bytes << " parameter bytes";
    for (const auto& p : model->named_parameters()) {
      EXPECT_TRUE(p.value().device().is_cpu() && p.value().is_pinned()) << p.key() << " on " << p.value().device();
    }
    optim::CPUAdam opt(model->parameters(), optim::CPUAdamOptions(1e-2).weight_decay(0.01));
    model->register_optimizer_in_backward(opt);
    auto train = [&](auto& m, torch::optim::Optimizer& optimizer, int s) {
      auto [x, y] = global_batch(s, kBatch);
      optimizer.zero_grad(/*set_to_none=*/true);
      torch::mse_loss(m->forward(x.to(gpu)), y.to(gpu)).backward();
      optimizer.step();
    };
    for (int s = 0; s < 4; ++s) {
      train(ref, ref_opt, s);
      train(model, opt, s);
    }
    expect_close_params(*model, *ref);
    // gpu_margin_mem_ratio 1: after the first backward this small model's shards and Adam state
    // all fit in the GPU's margin and move there; CPUAdam steps them with tensor ops on the GPU.
    auto placed = FullyShardedDataParallel(
        on_gpu(), pg, Options(o).cpu_offload(true).optimizer_in_backward(true).gpu_margin_mem_ratio(1.0));
    optim::CPUAdam placed_opt(placed->parameters(), optim::CPUAdamOptions(1e-2).weight_decay(0.01));
    placed->register_optimizer_in_backward(placed_opt);
    for (int s = 0; s < 4; ++s) {
      train(placed, placed_opt, s);
      if (s > 0) continue;
      auto sorted = [](std::vector<std::string> v) {
        std::sort(v.begin(), v.end());
        return v;
      };
      EXPECT_EQ(sorted(placed->units_placed_on_device()), sorted(placed->unit_paths()));
      EXPECT_EQ(placed->memory_stats().offloaded_bytes, 0);
      for (const auto& p : placed->named_parameters()) {
        EXPECT_TRUE(p.value().is_cuda()) << p.key();
        const auto st = fsdp::state::get_param_state(placed_opt, p.value());
        ASSERT_TRUE(st.has_value()) << p.key();
        for (const auto& kv : st->tensors) EXPECT_TRUE(kv.second.is_cuda()) << p.key() << "." << kv.first;
      }
    }
    expect_close_params(*placed, *ref);
  }, ro);
}

// ZeRO-2 with cpu_offload: the parameters stay on the GPU in their dtype; the masters CPUAdam
// steps are pinned host memory, the Adam state is on the host, and the run trains like ZeRO-2
// with torch's Adam on the GPU.
TEST(FsdpOffloadCuda, ZeroPartitionOnTheHostTrainsLikeAdamOnTheGpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  const RankOptions ro = nccl_options();
  run_ranks(1, [](comm::ProcessGroup& pg) {
    at::globalContext().setAllowTF32CuBLAS(false);
    const torch::Device gpu(torch::kCUDA, pg.cuda_device());
    namespace zo = fsdp::optim;
    auto make = [&](bool offload, double margin) {
      auto m = make_transformer();
      m->to(gpu);
      auto inner = offload ? zo::inner_optimizer<zo::CPUAdam>(zo::CPUAdamOptions(1e-2).weight_decay(0.01))
                           : zo::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-2).weight_decay(0.01));
      auto o = zo::ZeroOptions().process_group(pg).stage(2).module(m.ptr()).cpu_offload(offload)
                   .optimizer_in_backward(offload).gpu_margin_mem_ratio(margin);
      return std::make_pair(m, std::make_unique<zo::ZeroRedundancyOptimizer>(m->parameters(), inner, o));
    };
    auto [ref, ref_opt] = make(false, 0.0);
    auto [model, opt] = make(true, 0.0);
    for (const auto& pc : opt->local_pieces()) EXPECT_TRUE(pc.tensor.device().is_cpu() && pc.tensor.is_pinned());
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.device().is_cuda());
    for (int s = 0; s < 4; ++s) {
      auto [x, y] = global_batch(s, kBatch);
      ref_opt->zero_grad(/*set_to_none=*/true);
      torch::mse_loss(ref->forward(x.to(gpu)), y.to(gpu)).backward();
      ref_opt->step();
      opt->zero_grad(/*set_to_none=*/true);
      torch::mse_loss(model->forward(x.to(gpu)), y.to(gpu)).backward();
      opt->step();
    }
    const MemoryUsage u = opt->get_memory_usage();
    EXPECT_GT(u[MemoryCategory::kOptimizerState], 0);
    EXPECT_EQ(u.offloaded_bytes, u[MemoryCategory::kMasterWeights] + u[MemoryCategory::kOptimizerState] +
                                     4 * opt->partition_numel());
    for (const auto& pc : opt->local_pieces()) {
      const auto st = fsdp::state::get_param_state(opt->inner(), pc.tensor);
      ASSERT_TRUE(st.has_value());
      for (const auto& kv : st->tensors) EXPECT_TRUE(kv.second.device().is_cpu()) << kv.first << " on " << kv.second.device();
    }
    expect_close_params(*model, *ref);
    // gpu_margin_mem_ratio 1: after the first step this small model's masters and Adam state all
    // fit in the GPU's margin and move there; CPUAdam steps them with tensor ops on the GPU.
    auto [placed, placed_opt] = make(true, 1.0);
    for (int s = 0; s < 4; ++s) {
      auto [x, y] = global_batch(s, kBatch);
      placed_opt->zero_grad(/*set_to_none=*/true);
      torch::mse_loss(placed->forward(x.to(gpu)), y.to(gpu)).backward();
      placed_opt->step();
      if (s == 0) {
        EXPECT_EQ(placed_opt->num_buckets_on_device(), placed_opt->num_buckets());
        for (const auto& pc : placed_opt->local_pieces()) EXPECT_TRUE(pc.tensor.is_cuda());
      }
    }
    const MemoryUsage pu = placed_opt->get_memory_usage();
    EXPECT_EQ(pu.offloaded_bytes, pu[MemoryCategory::kMasterWeights] / 2 + 4 * placed_opt->partition_numel())
        << "left on the host: the host partition and the gradients' host copy";
    expect_close_params(*placed, *ref);
  }, ro);
}

// The rank's GPU, with the caching allocator capped at `cap` bytes.
torch::Device capped_gpu(const comm::ProcessGroup& pg, int64_t cap) {
  const torch::Device gpu(torch::kCUDA, pg.cuda_device());
  memory::set_device_memory_fraction(gpu, 1.0);
  const double capacity = static_cast<double>(memory::device_memory(gpu).capacity);
  memory::set_device_memory_fraction(gpu, static_cast<double>(cap) / capacity);
  return gpu;
}

// About 1B parameters (16 bias-free 8192x8192 layers, one unit each) under a GPU memory cap of
// 12 GiB (setMemoryFraction): their fp32 shards, gradients and Adam state, 16 B per parameter
// (17 GB), exceed it. Without offload, Adam stepping inside backward runs out of memory while
// creating a unit's state, and the error names the unit; with cpu_offload and CPUAdam on the
// host the same model trains (finite losses, parameters move) under the cap, and the GPU's peak
// stays under it.
TEST(FsdpOffloadCuda, BillionParametersTrainUnderACapOnlyWithOffload) {
  FSDP_SKIP_WITHOUT_GPU(1);
  const RankOptions ro = nccl_options();
  constexpr int64_t kDim = 8192, kLayers = 16;
  constexpr int64_t kCap = int64_t(12) << 30;
  auto billion = [] {
    torch::manual_seed(0);
    torch::nn::Sequential net;
    for (int64_t i = 0; i < kLayers; ++i) net->push_back(torch::nn::Linear(torch::nn::LinearOptions(kDim, kDim).bias(false)));
    return net;
  };
  run_ranks(1, [&](comm::ProcessGroup& pg) {
    const torch::Device gpu = capped_gpu(pg, kCap);
    auto net = billion();
    net->to(gpu);
    auto m = FullyShardedDataParallel(net, pg, Options().auto_wrap_policy(always_wrap_policy()).optimizer_in_backward(true));
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-4));
    m->register_optimizer_in_backward(opt);
    std::string message;
    try {
      m->forward(torch::randn({8, kDim}, gpu)).square().mean().backward();
    } catch (const c10::OutOfMemoryError& e) {
      message = e.what_without_backtrace();
    }
    EXPECT_NE(message.find("out of memory stepping the optimizer"), std::string::npos) << "'" << message << "'";
    EXPECT_NE(message.find("of unit '"), std::string::npos) << message;
  }, ro);
  run_ranks(1, [&](comm::ProcessGroup& pg) {
    const torch::Device gpu = capped_gpu(pg, kCap);
    auto net = billion();
    net->to(gpu);
    auto m = FullyShardedDataParallel(
        net, pg, Options().auto_wrap_policy(always_wrap_policy()).cpu_offload(true).optimizer_in_backward(true));
    optim::CPUAdam opt(m->parameters(), optim::CPUAdamOptions(1e-4));
    m->register_optimizer_in_backward(opt);
    const auto before = m->parameters()[0].detach().clone();
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad(/*set_to_none=*/true);
      auto loss = m->forward(torch::randn({8, kDim}, gpu)).square().mean();
      loss.backward();
      opt.step();
      EXPECT_TRUE(std::isfinite(loss.item<double>())) << "step " << s;
    }
    EXPECT_FALSE(torch::equal(before, m->parameters()[0])) << "the offloaded run did not step";
    EXPECT_LE(memory::device_memory(gpu).peak_allocated, kCap);
  }, ro);
}

}  // namespace
