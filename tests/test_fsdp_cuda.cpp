// FSDP and ZeRO on CUDA models (issue 33; ctest label gpu, run on a GPU machine by
// scripts/gpu_check.sh -L gpu). Every case skips, saying why, where no CUDA device is visible.
// Each case runs at one rank over NCCL and at two ranks sharing GPU 0 over Gloo (NCCL refuses two
// ranks on one GPU; docs/gpu.md). The model is moved to the rank's GPU before it is wrapped (or
// before a ZeRO optimizer is built over it), as a PyTorch user does.
//  1. FSDP FULL_SHARD, SHARD_GRAD_OP, NO_SHARD with Adam, step by step against plain libtorch
//     training of the same model on the same GPU on the global batch: every rank's gradient
//     pieces after each backward, the global loss of each step, the full parameters at the end.
//  2. ZeRO-1 (both reductions) and ZeRO-2 (with and without overlap), the same way, parameters
//     after every step.
//  3. bf16 and fp16 mixed precision (FULL_SHARD, fp32 masters) against mixed precision written out
//     by hand on the same GPU; fp16 with ShardedGradScaler, one step poisoned with an inf on the
//     last rank only and skipped by every rank, parameters and optimizer state untouched.
//  4. State across devices: the full state dict (through a file), the sharded state dict and a
//     checkpoint directory with Adam's state, saved from a CUDA model and loaded into a CPU model,
//     and the other way round: values equal to the bit.
//
// Tolerances. The CPU suites can ask for bitwise equality where they sum per-rank gradients in the
// library's order; here the reference computes the global batch in one pass, and cuBLAS picks its
// kernels (split-K, tile order) by shape and by the alignment of the operands, and FSDP's
// parameters are views into flat buffers at arbitrary offsets: the same maths is summed in another
// order. fp32: relative L2 < 1e-5 (a reordered fp32 sum differs by ~1e-7 relative; a wrong
// averaging factor or a stale shard is off by > 1e-2). TF32 is switched off for cuBLAS so that
// fp32 means fp32 (TF32's 10-bit mantissa would be ~1e-3). Low precision: relative L2 < 1e-2 (see
// kLowPrecisionTol).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp/comm/collectives.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/precision/grad_scaler.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/state_dict.h"
#include "harness/bit_equal.h"
#include "harness/gpu.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;
using fsdp::optim::Stage1Reduction;
using fsdp::optim::ZeroOptions;
using fsdp::optim::ZeroRedundancyOptimizer;
using fsdp::precision::DynamicGradScalerOptions;
using fsdp::precision::ShardedGradScaler;

namespace {

constexpr int kSteps = 4;
constexpr int64_t kBatch = 12;  // divides among 1 and 2 ranks
constexpr double kAdamLr = 1e-2;
constexpr double kFp32Tol = 1e-5;
// Both sides compute each rank's slice in the low dtype with the same ops and reduce it the same
// way, so what differs is kernel choice (see the top) and cuBLAS's reduced-precision split-K
// accumulation (on by default for bf16/fp16 GEMMs): an ulp of the low dtype on some elements
// (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4). A wrong averaging factor (0.5), a missing unscale
// (x1024) or a step taken on poisoned gradients is far outside it.
constexpr double kLowPrecisionTol = 1e-2;

using NamedTensors = std::map<std::string, torch::Tensor>;

torch::Device gpu(const comm::ProcessGroup& pg) { return torch::Device(torch::kCUDA, pg.cuda_device()); }

template <typename Holder>
Holder on_device(Holder m, torch::Device device) {
  m->to(device);
  return m;
}

// One rank over NCCL, then two ranks on one GPU over Gloo.
void at_one_and_two_ranks(const std::function<void(comm::ProcessGroup&)>& body) {
  for (auto [world, backend] : {std::pair{1, comm::Backend::kNccl}, std::pair{2, comm::Backend::kGloo}}) {
    RankOptions o;
    o.backend = backend;
    o.deadline = std::chrono::seconds(300);
    run_ranks(world, [&, backend = backend](comm::ProcessGroup& pg) {
      EXPECT_EQ(pg.cuda_backend(), backend);
      at::globalContext().setAllowTF32CuBLAS(false);  // fp32 means fp32 (see the top)
      body(pg);
    }, o);
  }
}

std::pair<torch::Tensor, torch::Tensor> batch_on(int64_t step, torch::Device device) {
  auto [x, y] = global_batch(step, kBatch);
  return {x.to(device), y.to(device)};
}

NamedTensors named_values(torch::nn::Module& m) {
  NamedTensors out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

NamedTensors named_grads(torch::nn::Module& m) {
  NamedTensors out;
  for (const auto& p : m.named_parameters())
    if (p.value().grad().defined()) out[p.key()] = p.value().grad().detach().clone();
  return out;
}

// Relative L2 difference of all of `b`'s tensors against the same names in `a`, compared on the CPU.
double rel_diff_all(const NamedTensors& a, const NamedTensors& b) {
  std::vector<torch::Tensor> xa, xb;
  for (const auto& [k, v] : b) {
    EXPECT_TRUE(a.count(k)) << k << " missing";
    if (!a.count(k)) return std::numeric_limits<double>::infinity();
    xa.push_back(a.at(k).reshape({-1}).cpu());
    xb.push_back(v.reshape({-1}).cpu());
  }
  return rel_diff(torch::cat(xa), torch::cat(xb));
}

// The mean of the ranks' losses: the global batch's loss, since the slices are equal.
double global_loss(comm::ProcessGroup& pg, const torch::Tensor& loss) {
  auto l = loss.detach().to(torch::kDouble).cpu().reshape({1});
  comm::all_reduce(pg, l, comm::ReduceOp::kAvg).wait();
  return l.item<double>();
}

// Each parameter's element range [begin, end) of its flattened full value that this rank holds
// (fixed at wrapping; the whole parameter under NO_SHARD).
using Ranges = std::map<std::string, std::pair<int64_t, int64_t>>;
Ranges piece_ranges(FullyShardedBase& m) {
  Ranges out;
  for (const auto& e : sharded_state_dict(m)) out[e.key()] = {e.value().begin, e.value().end};
  return out;
}

// This rank's gradient pieces (what its optimizer steps with) against the same ranges of the
// reference's full gradients; also that they are fp32 and on the GPU.
double grad_pieces_rel_diff(torch::nn::Module& wrapped, const Ranges& ranges, const NamedTensors& full) {
  std::vector<torch::Tensor> got, want;
  for (const auto& p : wrapped.named_parameters()) {
    const auto [begin, end] = ranges.at(p.key());
    if (begin == end) continue;
    const auto& g = p.value().grad();
    EXPECT_TRUE(g.defined()) << p.key();
    if (!g.defined()) continue;
    EXPECT_TRUE(g.is_cuda()) << p.key();
    EXPECT_EQ(g.scalar_type(), torch::kFloat) << p.key();
    got.push_back(g.detach().reshape({-1}).cpu());
    want.push_back(full.at(p.key()).reshape({-1}).slice(0, begin, end).cpu());
  }
  if (want.empty()) return 0;
  return rel_diff(torch::cat(got), torch::cat(want));
}

// The step loop of both parity suites: each of kSteps steps trains the reference with Adam on the
// global batch, then `train_step` on this rank's slice of it (x, y), given the reference's
// gradients of that step; it checks what its method promises and returns its loss, whose mean
// over the ranks must be the reference's.
using TrainStep = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& y,
                                              const NamedTensors& ref_grads)>;
template <typename Holder>
void steps_against_reference(comm::ProcessGroup& pg, Holder& ref, const TrainStep& train_step) {
  const auto dev = gpu(pg);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(kAdamLr));
  for (int s = 0; s < kSteps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    auto [x, y] = batch_on(s, dev);
    ref_opt.zero_grad(/*set_to_none=*/false);
    torch::Tensor ref_loss = torch::mse_loss(ref->forward(x), y);
    ref_loss.backward();
    const auto ref_grads = named_grads(*ref);
    ref_opt.step();

    auto loss = train_step(rank_slice(x, pg.rank(), pg.size()), rank_slice(y, pg.rank(), pg.size()), ref_grads);
    const double expected = ref_loss.item<double>();
    EXPECT_NEAR(global_loss(pg, loss), expected, kFp32Tol * std::abs(expected));
  }
}

// ---- 1. FSDP against plain training on the same GPU ----

template <typename Make>
void fsdp_parity(comm::ProcessGroup& pg, const std::string& name, Make make, const Options& options) {
  run_case(name, [&] {
    const auto dev = gpu(pg);
    auto ref = on_device(make(), dev);
    auto model = FullyShardedDataParallel(on_device(make(), dev), pg, options);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(kAdamLr));
    const auto ranges = piece_ranges(*model);
    for (auto& p : model->parameters()) EXPECT_TRUE(p.is_cuda()) << "a shard left the model's device";
    steps_against_reference(pg, ref, [&](const torch::Tensor& x, const torch::Tensor& y,
                                         const NamedTensors& ref_grads) {
      opt.zero_grad(/*set_to_none=*/false);
      auto out = model->forward(x);
      EXPECT_TRUE(out.is_cuda());
      auto loss = torch::mse_loss(out, y);
      loss.backward();
      EXPECT_LT(grad_pieces_rel_diff(*model, ranges, ref_grads), kFp32Tol);
      opt.step();
      return loss;
    });
    auto full = full_params(model);
    for (const auto& [k, v] : full) EXPECT_TRUE(v.is_cuda()) << k;
    EXPECT_LT(rel_diff_all(full, named_values(*ref)), kFp32Tol);
  });
}

void fsdp_parity_cases(comm::ProcessGroup& pg) {
  for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    const std::string s = to_string(strategy);
    fsdp_parity(pg, "mlp/" + s, [] { return make_mlp(); },
                Options().sharding_strategy(strategy).auto_wrap_policy(always_wrap_policy()));
    // Nested units (blocks, and their MLP layers inside them), LayerNorm and GELU kernels.
    fsdp_parity(pg, "transformer/" + s, [] { return make_transformer(); },
                Options().sharding_strategy(strategy).auto_wrap_policy(size_based_policy(100)));
  }
}

// ---- 2. ZeRO-1 / ZeRO-2 against plain training on the same GPU ----

template <typename Make>
void zero_parity(comm::ProcessGroup& pg, const std::string& name, Make make, int stage, Stage1Reduction reduction,
                 bool overlap) {
  run_case(name, [&] {
    const auto dev = gpu(pg);
    auto ref = on_device(make(), dev);
    auto model = on_device(make(), dev);
    // Buckets of 100 elements: buckets, partitions and parameters cut each other.
    ZeroRedundancyOptimizer opt(model->parameters(),
                                fsdp::optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(kAdamLr)),
                                ZeroOptions()
                                    .process_group(pg)
                                    .stage(stage)
                                    .stage1_reduction(reduction)
                                    .overlap_communication(overlap)
                                    .reduce_bucket_size(100)
                                    .module(model.ptr()));
    steps_against_reference(pg, ref, [&](const torch::Tensor& x, const torch::Tensor& y,
                                         const NamedTensors& ref_grads) {
      opt.zero_grad(/*set_to_none=*/true);
      auto loss = torch::mse_loss(model->forward(x), y);
      loss.backward();
      opt.step();
      // Stage 1's all-reduce leaves the averaged full gradients in grad().
      if (stage == 1 && reduction == Stage1Reduction::kAllReduce) {
        EXPECT_LT(rel_diff_all(named_grads(*model), ref_grads), kFp32Tol);
      }
      // The reference has stepped already: the parameters after this step on both sides.
      auto values = named_values(*model);
      for (const auto& [k, v] : values) EXPECT_TRUE(v.is_cuda()) << k;
      EXPECT_LT(rel_diff_all(values, named_values(*ref)), kFp32Tol);
      return loss;
    });
  });
}

void zero_parity_cases(comm::ProcessGroup& pg) {
  using R = Stage1Reduction;
  // name, stage, stage 1's reduction, overlap
  const std::tuple<const char*, int, R, bool> variants[] = {
      {"zero1_all_reduce", 1, R::kAllReduce, false}, {"zero1_reduce_scatter", 1, R::kReduceScatter, false},
      {"zero2", 2, R::kAllReduce, false}, {"zero2_overlap", 2, R::kAllReduce, true}};
  for (const auto& [name, stage, reduction, overlap] : variants) {
    zero_parity(pg, std::string("mlp/") + name, [] { return make_mlp(); }, stage, reduction, overlap);
    zero_parity(pg, std::string("transformer/") + name, [] { return make_transformer(); }, stage, reduction, overlap);
  }
}

// ---- 3. Mixed precision against the same method written out by hand ----

// SGD, unlike Adam, sees the gradient's scale: a wrong averaging factor or unscale shows.
const torch::optim::SGDOptions kSgd = torch::optim::SGDOptions(0.05).momentum(0.9);
constexpr uint64_t kMpSeed = 7;

// PyTorch's split of the 1/world average into a division before the reduction and one after it
// (written out, as in test_mixed_precision, not taken from the library).
double predivide_factor(int world) {
  int factor = 1;
  while (world % factor == 0 && world / factor > factor) factor *= 2;
  return factor;
}

struct ByHandRun {
  std::vector<NamedTensors> grads;  ///< the fp32, unscaled, averaged gradients of each step
  NamedTensors params;              ///< fp32 masters at the end
};

// fp32 masters and a copy in `dtype` on the GPU; each step casts the masters into the copy, runs
// every rank's slice through it with the loss times scales[s], reduces the gradients as the
// library does (in `dtype`: / predivide, summed in rank order, / the rest), casts them to fp32,
// unscales, and steps SGD on the masters. Step `skipped` (if any) is one every rank skips.
ByHandRun by_hand_low_precision(torch::Device dev, int world, at::ScalarType dtype, const std::vector<double>& scales,
                                int skipped) {
  auto master = on_device(make_mlp(kMpSeed), dev);
  auto low = on_device(make_mlp(kMpSeed), dev);
  low->to(dtype);
  torch::optim::SGD opt(master->parameters(), kSgd);
  const auto mp = master->named_parameters();
  const auto lp = low->named_parameters();
  const double pre = predivide_factor(world), post = world / pre;
  ByHandRun run;
  for (size_t s = 0; s < scales.size(); ++s) {
    run.grads.emplace_back();
    if (static_cast<int>(s) == skipped) continue;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < mp.size(); ++i) lp[i].value().copy_(mp[i].value());
    }
    auto [x, y] = batch_on(static_cast<int64_t>(s), dev);
    std::vector<torch::Tensor> sum(lp.size());
    for (int r = 0; r < world; ++r) {
      low->zero_grad(/*set_to_none=*/true);
      auto out = low->forward(rank_slice(x, r, world).to(dtype));
      (torch::mse_loss(out.to(torch::kFloat), rank_slice(y, r, world)) * scales[s]).backward();
      for (size_t i = 0; i < lp.size(); ++i) {
        auto g = lp[i].value().grad().to(dtype).clone();
        if (pre != 1) g.div_(pre);
        sum[i] = r == 0 ? g : sum[i] + g;
      }
    }
    for (size_t i = 0; i < mp.size(); ++i) {
      auto g = sum[i];
      if (post != 1) g = g / post;
      g = g.to(torch::kFloat) / scales[s];
      run.grads.back()[mp[i].key()] = g.clone();
      mp[i].value().mutable_grad() = g;
    }
    opt.step();
  }
  run.params = named_values(*master);
  return run;
}

// Parameters and momentum buffers, for "the skipped step changed nothing".
std::vector<torch::Tensor> sgd_snapshot(torch::optim::SGD& opt) {
  std::vector<torch::Tensor> out;
  for (auto& g : opt.param_groups())
    for (auto& p : g.params()) {
      out.push_back(p.detach().clone());
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it != opt.state().end())
        out.push_back(static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().clone());
    }
  return out;
}

// FULL_SHARD with param_dtype `dtype`. With the scaler (initial scale 1024, backing off at the
// first overflow), step 2's gradient piece on the last rank gets an inf after backward.
void mixed_precision_case(comm::ProcessGroup& pg, at::ScalarType dtype, bool with_scaler) {
  const int n = pg.size(), r = pg.rank();
  const auto dev = gpu(pg);
  const int poisoned = with_scaler ? 2 : -1;
  // The scale of each step: the overflow at step 2 halves it (hysteresis 1).
  const auto scales = with_scaler ? std::vector<double>{1024, 1024, 1024, 512} : std::vector<double>(kSteps, 1);
  const auto ref = by_hand_low_precision(dev, n, dtype, scales, poisoned);

  auto model = FullyShardedDataParallel(on_device(make_mlp(kMpSeed), dev), pg,
                                        Options()
                                            .sharding_strategy(ShardingStrategy::kFullShard)
                                            .auto_wrap_policy(always_wrap_policy())
                                            .mixed_precision(MixedPrecision().param_dtype(dtype)));
  torch::optim::SGD opt(model->parameters(), kSgd);
  ShardedGradScaler scaler(pg, DynamicGradScalerOptions().initial_scale(1024).hysteresis(1));
  const auto ranges = piece_ranges(*model);
  for (int s = 0; s < kSteps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    auto [x, y] = batch_on(s, dev);
    opt.zero_grad(/*set_to_none=*/false);
    auto out = model->forward(rank_slice(x, r, n));
    EXPECT_EQ(out.scalar_type(), dtype) << "the layers did not compute in the low dtype";
    auto loss = torch::mse_loss(out.to(torch::kFloat), rank_slice(y, r, n));
    if (with_scaler) {
      EXPECT_EQ(scaler.get_scale(), scales[s]);
      scaler.scale(loss).backward();
    } else {
      loss.backward();
    }
    if (s == poisoned && r == n - 1) {
      for (auto& p : model->parameters())
        if (p.grad().defined() && p.grad().numel() > 0) {
          p.grad().view(-1)[0] = std::numeric_limits<float>::infinity();
          break;
        }
    }
    if (with_scaler) {
      scaler.unscale_(opt);
      EXPECT_EQ(scaler.found_inf(), s == poisoned) << "every rank must see the one rank's inf";
    }
    if (s != poisoned) {
      EXPECT_LT(grad_pieces_rel_diff(*model, ranges, ref.grads[s]), kLowPrecisionTol);
    }
    const auto before = sgd_snapshot(opt);
    bool stepped = true;
    if (with_scaler) {
      stepped = scaler.step(opt);
      scaler.update();
    } else {
      opt.step();
    }
    EXPECT_EQ(stepped, s != poisoned);
    if (s == poisoned) {
      EXPECT_TRUE(bit_equal(before, sgd_snapshot(opt))) << "the skipped step changed parameters or momentum";
      EXPECT_EQ(scaler.get_scale(), 512);
    }
  }
  for (auto& p : model->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat) << "masters must stay fp32";
    EXPECT_TRUE(p.is_cuda());
  }
  EXPECT_LT(rel_diff_all(full_params(model), ref.params), kLowPrecisionTol);
}

// ---- 4. State dicts and checkpoints between a CUDA and a CPU model ----

using Transformer = FullyShardedDataParallel<TinyTransformerImpl>;

Options checkpoint_options() {
  return Options().sharding_strategy(ShardingStrategy::kFullShard).auto_wrap_policy(size_based_policy(100));
}

// Two Adam steps, so that parameters and optimizer state are not the initial ones.
void train_two_steps(comm::ProcessGroup& pg, Transformer& model, torch::optim::Adam& opt, torch::Device dev) {
  for (int s = 0; s < 2; ++s) {
    auto [x, y] = batch_on(s, dev);
    opt.zero_grad(/*set_to_none=*/false);
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()))
        .backward();
    opt.step();
  }
}

// Adam's moments and step count of every parameter in order, on the CPU.
std::vector<torch::Tensor> adam_state(torch::optim::Adam& opt, torch::Device expected_device) {
  std::vector<torch::Tensor> out;
  for (auto& g : opt.param_groups())
    for (auto& p : g.params()) {
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      auto& st = static_cast<torch::optim::AdamParamState&>(*it->second);
      EXPECT_EQ(st.exp_avg().device(), expected_device);
      out.push_back(st.exp_avg().cpu());
      out.push_back(st.exp_avg_sq().cpu());
      out.push_back(torch::tensor(st.step()));
    }
  return out;
}

void expect_same_values(const NamedTensors& got, const NamedTensors& want, torch::Device device) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [k, v] : want) {
    ASSERT_TRUE(got.count(k)) << k;
    EXPECT_EQ(got.at(k).device(), device) << k;
    EXPECT_TRUE(torch::equal(got.at(k).cpu(), v.cpu())) << k;
  }
}

NamedTensors as_named(const StateDict& sd) {
  NamedTensors out;
  for (const auto& e : sd) out[e.key()] = e.value();
  return out;
}

void checkpoint_cases(comm::ProcessGroup& pg) {
  const auto dev = gpu(pg);
  const torch::Device cpu(torch::kCPU);
  const std::string rank = std::to_string(pg.rank());
  // A trained model on each device, with different seeds: a load that did nothing shows.
  Transformer on_gpu(on_device(make_transformer(1), dev), pg, checkpoint_options());
  torch::optim::Adam gpu_opt(on_gpu->parameters(), torch::optim::AdamOptions(kAdamLr));
  train_two_steps(pg, on_gpu, gpu_opt, dev);
  Transformer on_cpu(make_transformer(2), pg, checkpoint_options());
  torch::optim::Adam cpu_opt(on_cpu->parameters(), torch::optim::AdamOptions(kAdamLr));
  train_two_steps(pg, on_cpu, cpu_opt, cpu);
  const auto gpu_values = full_params(on_gpu), cpu_values = full_params(on_cpu);

  run_case("full state dict: CUDA to CPU through a file", [&] {
    StateDict sd;
    {
      StateDictTypeGuard guard(*on_gpu, StateDictType::kFull, FullStateDictConfig().offload_to_cpu(true));
      sd = state_dict(*on_gpu);
    }
    expect_same_values(as_named(sd), gpu_values, cpu);  // offload_to_cpu: CPU tensors
    const std::string path = worker_scratch_dir() + "/full-" + rank + ".pt";
    save_full_state_dict(sd, path);
    Transformer target(make_transformer(3), pg, checkpoint_options());
    load_state_dict(*target, load_full_state_dict(path));
    expect_same_values(full_params(target), gpu_values, cpu);
  });
  run_case("full state dict without offload stays on the GPU; CPU to CUDA", [&] {
    expect_same_values(as_named(state_dict(*on_gpu)), gpu_values, dev);  // as PyTorch's FSDP
    Transformer target(on_device(make_transformer(3), dev), pg, checkpoint_options());
    load_state_dict(*target, state_dict(*on_cpu));
    expect_same_values(full_params(target), cpu_values, dev);
  });
  run_case("sharded state dict both ways", [&] {
    Transformer to_cpu(make_transformer(3), pg, checkpoint_options());
    load_sharded_state_dict(*to_cpu, sharded_state_dict(*on_gpu));
    expect_same_values(full_params(to_cpu), gpu_values, cpu);
    Transformer to_gpu(on_device(make_transformer(3), dev), pg, checkpoint_options());
    load_sharded_state_dict(*to_gpu, sharded_state_dict(*on_cpu));
    expect_same_values(full_params(to_gpu), cpu_values, dev);
  });
  run_case("checkpoint directory with Adam state both ways", [&] {
    const std::string from_gpu = worker_scratch_dir() + "/ckpt-from-gpu";
    const std::string from_cpu = worker_scratch_dir() + "/ckpt-from-cpu";
    save_checkpoint(from_gpu, *on_gpu, &gpu_opt);
    save_checkpoint(from_cpu, *on_cpu, &cpu_opt);
    Transformer to_cpu(make_transformer(3), pg, checkpoint_options());
    torch::optim::Adam to_cpu_opt(to_cpu->parameters(), torch::optim::AdamOptions(kAdamLr));
    load_checkpoint(from_gpu, *to_cpu, &to_cpu_opt);
    expect_same_values(full_params(to_cpu), gpu_values, cpu);
    const auto loaded_on_cpu = adam_state(to_cpu_opt, cpu);
    EXPECT_FALSE(loaded_on_cpu.empty()) << "no optimizer state was loaded";
    EXPECT_TRUE(bit_equal(loaded_on_cpu, adam_state(gpu_opt, dev)));
    Transformer to_gpu(on_device(make_transformer(3), dev), pg, checkpoint_options());
    torch::optim::Adam to_gpu_opt(to_gpu->parameters(), torch::optim::AdamOptions(kAdamLr));
    load_checkpoint(from_cpu, *to_gpu, &to_gpu_opt);
    expect_same_values(full_params(to_gpu), cpu_values, dev);
    const auto loaded_on_gpu = adam_state(to_gpu_opt, dev);
    EXPECT_FALSE(loaded_on_gpu.empty()) << "no optimizer state was loaded";
    EXPECT_TRUE(bit_equal(loaded_on_gpu, adam_state(cpu_opt, cpu)));
    // The loaded state trains on: one more step on the GPU runs and stays finite.
    train_two_steps(pg, to_gpu, to_gpu_opt, dev);
    for (auto& p : to_gpu->parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
  });
}

}  // namespace

TEST(FsdpCuda, ParityWithPlainTrainingOnTheGpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  at_one_and_two_ranks(fsdp_parity_cases);
}

TEST(FsdpCuda, ZeroParityWithPlainTrainingOnTheGpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  at_one_and_two_ranks(zero_parity_cases);
}

TEST(FsdpCuda, MixedPrecisionAgainstByHandCasts) {
  FSDP_SKIP_WITHOUT_GPU(1);
  at_one_and_two_ranks([](comm::ProcessGroup& pg) {
    run_case("bf16", [&] { mixed_precision_case(pg, torch::kBFloat16, /*with_scaler=*/false); });
    run_case("fp16_scaler_skips_an_inf_on_one_rank",
             [&] { mixed_precision_case(pg, torch::kHalf, /*with_scaler=*/true); });
  });
}

TEST(FsdpCuda, StateDictsAndCheckpointsAcrossDevices) {
  FSDP_SKIP_WITHOUT_GPU(1);
  at_one_and_two_ranks(checkpoint_cases);
}
