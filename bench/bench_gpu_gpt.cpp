// bench_gpu_gpt: the one-GPU speed benchmark of issue 33 (item 7), not a test. A GPT-style
// model of ~1.3 B parameters trained on one GPU by plain libtorch and by
// fsdp::FullyShardedDataParallel FULL_SHARD at one rank over NCCL, alternating in one process,
// on the same data, with the same math; bench/fsdp2_gpt.py is the same model under PyTorch FSDP2
// (and plain PyTorch). Both run on a GPU machine through scripts/gpu_bench.sh
// (GPU_BENCH_GPT=1; docs/gpu.md); without a CUDA device this program says so and exits 0.
//
// Usage:
//   bench_gpu_gpt [--steps 10] [--warmup 2] [--rounds 3] [--modes plain,fsdp]
//                 [--layers 24] [--width 2048] [--heads 16] [--vocab 32000] [--batch 8] [--seq 1024]
//                 [--reduce-dtype fp32|bf16] [--forward-prefetch] [--lr 1e-4] [--tiny] [--cpu]
//
// --tiny: 2 blocks, width 128, 4 heads, vocabulary 1000, batch 2 x 64 (explicit flags win);
// --cpu: the same program on the CPU (FSDP over Gloo at one rank), to try its logic on a machine
// without a GPU (`bench_gpu_gpt --tiny --cpu`); its times mean nothing, its memory figures are 0.
//
// The model (same as bench/fsdp2_gpt.py, parameter for parameter and in the same creation order):
// token embedding wte [vocab, width] (tied: also the output projection, no bias), position
// embedding wpe [seq, width], `layers` pre-LayerNorm blocks
//     x = x + proj(SDPA_causal(split_heads(qkv(LN1(x)))));  x = x + fc2(GELU(fc1(LN2(x))))
// (qkv width -> 3 width, proj width -> width, fc1 width -> 4 width, fc2 4 width -> width, all
// with biases; exact GELU; at::scaled_dot_product_attention(q, k, v, {}, 0, is_causal=true)),
// a final LayerNorm, logits = LN_f(x) wte^T, loss = cross_entropy(logits in fp32, next token).
// Defaults: 24 blocks, width 2048, 16 heads, vocabulary 32000: 1.276 B parameters; batch 8 x
// 1024 tokens. Every parameter is created directly on the GPU (before wrapping) from the
// device's default generator seeded with 0: matrices and embeddings N(0, 0.02), biases 0,
// LayerNorm weight 1 and bias 0. Data: `--batches` (4) batches of uniform random tokens made on
// the GPU from seed 1234, used in turn by every mode (x = tokens[:, :-1], y = tokens[:, 1:]).
//
// The modes compute the same thing in bf16 with fp32 master weights:
//  * PLAIN: the model's fp32 parameters; the forward casts each of them to bf16 where it is
//    used (once per parameter per step; the tied wte once for both its uses), a
//    differentiable cast, so backward computes the bf16 gradients and accumulates them into
//    fp32 .grad: what FSDP's MixedPrecision(param_dtype=bf16) does with its fp32 shards (cast,
//    gather in bf16, compute, reduce, fp32 gradient pieces), without the collectives.
//  * FULL_SHARD: fsdp::FullyShardedDataParallel at one rank, NCCL (InitOptions::backend NCCL,
//    a file store), each block a unit (module_type_policy<BlockImpl>), the root holding the
//    embeddings and the final LayerNorm, MixedPrecision(param_dtype=bf16, reduce_dtype=fp32 by
//    default; --reduce-dtype bf16), backward_prefetch BACKWARD_PRE (the default). The forward's
//    casts are then no-ops (the gathered parameters are bf16 already): casts_per_step says so.
//  * FULL_SHARD_OFFLOAD (--modes offload, not run by default): FULL_SHARD with
//    Options::cpu_offload and optimizer_in_backward: fp32 shards, gradients and Adam state in
//    pinned host memory, each unit stepped by fsdp::optim::CPUAdam on the host (all the cores the
//    process has) as its gradient lands; bench/fsdp2_gpt.py --modes fsdp2_offload is its FSDP2
//    counterpart (CPUOffloadPolicy).
//  * FULL_SHARD_OFFLOAD_AUTO (--modes offload_auto, not run by default): the same with placement
//    auto (Options::gpu_margin_mem_ratio, --gpu-margin-mem-ratio): after the first step the units
//    whose shard and Adam state fit in that fraction of the GPU's free margin move back to it and
//    are stepped there; units_on_device says how many.
//  The offload modes also report host_wait_ms and gpu_waits_for_host_share: how long each timed
//  step's end of backward waited for the host thread's steps (the "host_steps" span of FSDP's
//  trace, on while they run; the device has no work then), per step and as a share of the step.
// PLAIN and FULL_SHARD step with the fused kernel at::_fused_adam_ (lr 1e-4, betas 0.9/0.999, eps
// 1e-8, no weight decay: torch.optim.Adam(fused=True)'s defaults but lr) over the fp32 parameters
// (FSDP: the model's parameters(), its fp32 shards), its state made at construction; gradients are
// set to none before each step (clear_grads: set_to_none=True, as in Python).
//
// Measured: every mode runs `--rounds` phases, alternating (plain, fsdp, plain, fsdp, ...); a
// phase is `--warmup` untimed steps, then `--steps` steps each timed alone with
// torch::cuda::synchronize() before and after. step_ms is the median over all timed steps of a
// mode (also the min, the mean, and per-round medians); tokens_per_s = batch * seq / step_ms.
// peak_bytes: the CUDA caching allocator's peak allocated bytes (getDeviceStats(device)
// .allocated_bytes[0].peak, reset with resetPeakStats before each phase's timed steps), the
// highest over the phases, less the bytes the *other* mode's model and optimizer state hold
// between its phases (both stay on the GPU; peak_allocated_bytes keeps the raw figure and
// other_mode_bytes what was subtracted), so that each mode's figure is what it alone needs
// (`--modes fsdp` measures one mode alone). Collectives: an observer on the library's one
// collective choke point (comm/collective_call.h, as bench_strategies counts them) counts the
// all-gathers, reduce-scatters and all-reduces FSDP issues during the timed steps, and their
// bytes, per step: at one rank the library issues the same per-unit collectives as at N > 1
// (CUDA tensors go to NCCL even in a group of one). losses: each mode's loss at every step, in
// order (warm-up included); max_loss_diff_vs_plain compares FSDP's to plain's step by step (same
// data, same math; flash attention's backward is not bitwise deterministic, so expect ~1e-3,
// not 0). A mode that fails (an exception: FSDP without device support, out of memory) gets an
// "error" field and leaves the others running.
//
// Output: a line per mode in words, then one JSON object per line: one per mode
// ("strategy": "PLAIN" or "FULL_SHARD"; step_ms, tokens_per_s, peak_bytes, collectives per
// step, ...) and the target line {"target": "full_shard_vs_plain", "goal": 0.95, "ratio": ...}
// (ratio of tokens/s, from the medians; ratio_per_round from each round's medians). The ratio
// against FSDP2 is computed by scripts/gpu_bench.sh from this and bench/fsdp2_gpt.py's lines.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#ifdef FSDP_BENCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "common/tool_error.h"
#include "comm/collective_call.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/options.h"
#include "fsdp/core/wrappable.h"
#include "fsdp/optim/cpu_adam.h"

namespace {

constexpr const char* kName = "bench_gpu_gpt";
constexpr const char* kNoGpu = "no CUDA device: this benchmark runs on a GPU machine (scripts/gpu_bench.sh)";

struct Args {
  int64_t layers = 24, width = 2048, heads = 16, vocab = 32000, batch = 8, seq = 1024;
  int steps = 10, warmup = 2, rounds = 3, batches = 4;
  std::vector<std::string> modes{"plain", "fsdp"};
  std::string reduce_dtype = "fp32";
  bool forward_prefetch = false;
  double gpu_margin_mem_ratio = 0.8;  // offload_auto
  double lr = 1e-4;
  bool cpu = false;  // smoke test of this program's logic on the CPU (Gloo), no GPU figures
};

// ---- device figures (CUDA only where this build's libtorch has it) ----

// The device the run uses: a CUDA device, or the CPU under --cpu (where every memory figure is 0).
struct Dev {
  bool cuda = true;
  int index = 0;
};

#ifdef FSDP_BENCH_CUDA
// allocated_bytes[0]: StatType::AGGREGATE (every pool).
int64_t allocated_now(Dev d) {
  if (!d.cuda) return 0;
  return c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(d.index)).allocated_bytes[0].current;
}
int64_t allocated_peak(Dev d) {
  if (!d.cuda) return 0;
  return c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(d.index)).allocated_bytes[0].peak;
}
void reset_peak(Dev d) {
  if (d.cuda) c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(d.index));
}
void release_cached(Dev d) {
  if (d.cuda) c10::cuda::CUDACachingAllocator::emptyCache();
}
void use_device(Dev d) {
  if (d.cuda) c10::cuda::set_device(static_cast<c10::DeviceIndex>(d.index));
}
std::string device_name(Dev d) {
  return d.cuda ? at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(d.index))->name : "cpu";
}
#else
int64_t allocated_now(Dev) { return 0; }
int64_t allocated_peak(Dev) { return 0; }
void reset_peak(Dev) {}
void release_cached(Dev) {}
void use_device(Dev) {}
std::string device_name(Dev) { return "cpu"; }
#endif
// torch::cuda::synchronize() (the CPU has nothing to wait for).
void sync(Dev d) {
  if (d.cuda) torch::cuda::synchronize();
}

// ---- the model ----

// Casts the forward performed (plain: one per parameter per step; FSDP: none).
std::atomic<int64_t> g_casts{0};

// A parameter as the forward uses it: in bf16. FSDP's gathered parameters already are
// (MixedPrecision param_dtype); the plain model's fp32 parameters are cast here, differentiably.
at::Tensor bf16(const at::Tensor& p) {
  if (p.scalar_type() == at::kBFloat16) return p;
  g_casts.fetch_add(1, std::memory_order_relaxed);
  return p.to(at::kBFloat16);
}

at::Tensor normal_param(at::IntArrayRef shape, const at::TensorOptions& o) {
  return torch::empty(shape, o).normal_(0.0, 0.02);
}

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, int64_t heads, const at::TensorOptions& o) : heads_(heads) {
    const int64_t c = width;
    ln1_w = register_parameter("ln1_w", torch::ones({c}, o));
    ln1_b = register_parameter("ln1_b", torch::zeros({c}, o));
    qkv_w = register_parameter("qkv_w", normal_param({3 * c, c}, o));
    qkv_b = register_parameter("qkv_b", torch::zeros({3 * c}, o));
    proj_w = register_parameter("proj_w", normal_param({c, c}, o));
    proj_b = register_parameter("proj_b", torch::zeros({c}, o));
    ln2_w = register_parameter("ln2_w", torch::ones({c}, o));
    ln2_b = register_parameter("ln2_b", torch::zeros({c}, o));
    fc1_w = register_parameter("fc1_w", normal_param({4 * c, c}, o));
    fc1_b = register_parameter("fc1_b", torch::zeros({4 * c}, o));
    fc2_w = register_parameter("fc2_w", normal_param({c, 4 * c}, o));
    fc2_b = register_parameter("fc2_b", torch::zeros({c}, o));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2), d = c / heads_;
    auto h = at::layer_norm(x, {c}, bf16(ln1_w), bf16(ln1_b), 1e-5);
    auto qkv = at::linear(h, bf16(qkv_w), bf16(qkv_b)).split(c, 2);
    auto q = qkv[0].view({b, t, heads_, d}).transpose(1, 2);
    auto k = qkv[1].view({b, t, heads_, d}).transpose(1, 2);
    auto v = qkv[2].view({b, t, heads_, d}).transpose(1, 2);
    auto y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
    y = y.transpose(1, 2).reshape({b, t, c});
    x = x + at::linear(y, bf16(proj_w), bf16(proj_b));
    h = at::layer_norm(x, {c}, bf16(ln2_w), bf16(ln2_b), 1e-5);
    return x + at::linear(at::gelu(at::linear(h, bf16(fc1_w), bf16(fc1_b))), bf16(fc2_w), bf16(fc2_b));
  }
  int64_t heads_;
  torch::Tensor ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

struct GptImpl : torch::nn::Module {
  GptImpl(const Args& a, const at::TensorOptions& o) : width_(a.width) {
    wte = register_parameter("wte", normal_param({a.vocab, a.width}, o));
    wpe = register_parameter("wpe", normal_param({a.seq, a.width}, o));
    auto h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < a.layers; ++i) {
      blocks.push_back(fsdp::Wrappable<BlockImpl>(a.width, a.heads, o));
      h->push_back(blocks.back());
    }
    lnf_w = register_parameter("lnf_w", torch::ones({a.width}, o));
    lnf_b = register_parameter("lnf_b", torch::zeros({a.width}, o));
  }
  // Token ids [B, T] -> logits [B, T, vocab] in bf16.
  torch::Tensor forward(torch::Tensor idx) {
    auto emb = bf16(wte);  // one cast for both uses (tied): the same math as FSDP's one gathered copy
    auto pos = torch::arange(idx.size(1), idx.options());
    auto x = at::embedding(emb, idx) + at::embedding(bf16(wpe), pos);
    for (auto& blk : blocks) x = blk->forward(x);
    x = at::layer_norm(x, {width_}, bf16(lnf_w), bf16(lnf_b), 1e-5);
    return at::linear(x, emb);
  }
  int64_t width_;
  torch::Tensor wte, wpe, lnf_w, lnf_b;
  std::vector<fsdp::Wrappable<BlockImpl>> blocks;
};
TORCH_MODULE(Gpt);

// ---- Adam through the fused kernel (torch::optim::Adam is a per-tensor loop) ----

class FusedAdam {
 public:
  FusedAdam(std::vector<at::Tensor> params, double lr) : params_(std::move(params)), lr_(lr) {
    torch::NoGradGuard no_grad;
    for (const auto& p : params_) {
      exp_avg_.push_back(torch::zeros_like(p, at::MemoryFormat::Preserve));
      exp_avg_sq_.push_back(torch::zeros_like(p, at::MemoryFormat::Preserve));
      // As torch.optim.Adam(fused=True): a float32 step counter on the parameter's device.
      steps_.push_back(torch::zeros({}, p.options().dtype(at::kFloat)));
    }
  }
  void clear_grads() {
    for (auto& p : params_) p.mutable_grad().reset();
  }
  // torch.optim.Adam(fused=True)'s _fused_adam: steps += 1, then one fused launch (per
  // device and dtype; here one) over every parameter that has a gradient.
  void step() {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> p, g, m, v, s;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& grad = params_[i].grad();
      if (!grad.defined()) continue;
      p.push_back(params_[i]);
      g.push_back(grad);
      m.push_back(exp_avg_[i]);
      v.push_back(exp_avg_sq_[i]);
      s.push_back(steps_[i]);
    }
    if (p.empty()) return;
    at::_foreach_add_(s, c10::Scalar(1.0));
    at::_fused_adam_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr_, 0.9, 0.999, /*weight_decay=*/0.0, 1e-8,
                     /*amsgrad=*/false, /*maximize=*/false);
  }
  size_t size() const { return params_.size(); }

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, steps_;
  double lr_;
};

// ---- the modes ----

struct Counts {
  std::atomic<int64_t> all_gather{0}, reduce_scatter{0}, all_reduce{0}, other{0}, bytes{0};
};

struct Mode {
  std::string key;   // "plain" | "fsdp" | "offload" | "offload_auto"
  std::string name;  // "PLAIN" | "FULL_SHARD" | "FULL_SHARD_OFFLOAD" | "FULL_SHARD_OFFLOAD_AUTO"
  Gpt plain{nullptr};
  fsdp::FullyShardedDataParallel<GptImpl> wrapped{nullptr};
  std::unique_ptr<FusedAdam> opt;                    // plain, fsdp: on the GPU
  std::unique_ptr<fsdp::optim::CPUAdam> host_opt;    // offload: on the host, inside backward
  Counts counts;                                     // collectives of its timed steps
  int64_t footprint = 0;  // bytes its model and optimizer hold between its phases
  int64_t params = 0;     // parameters (full model)
  int64_t units = 0;
  std::vector<double> ms;                       // every timed step
  std::vector<double> host_wait_ms;             // offload modes: every timed step's wait for the host
  std::vector<std::vector<double>> round_ms;    // per round
  std::vector<double> losses;                   // every step, warm-up included
  int64_t peak_raw = 0, peak_alone = 0, other_bytes = 0;
  int64_t casts = 0, timed_steps = 0, next_batch = 0;
  std::string error;
  bool alive() const { return error.empty() && (opt != nullptr || host_opt != nullptr); }
  bool sharded() const { return key != "plain"; }
  bool offloaded() const { return key == "offload" || key == "offload_auto"; }
  void clear_grads() {
    if (opt) opt->clear_grads();
    if (host_opt) host_opt->zero_grad(/*set_to_none=*/true);
  }
  // The offload mode stepped every unit inside backward: its step() finds nothing to do.
  void step_optimizer() {
    if (opt) opt->step();
    if (host_opt) host_opt->step();
  }
  torch::Tensor forward(const torch::Tensor& x) { return wrapped ? wrapped->forward(x) : plain->forward(x); }
  void release() {
    opt.reset();
    host_opt.reset();
    plain = nullptr;
    wrapped = nullptr;
  }
};

// The offload modes' wait for the host in the step just taken: FSDP's "host_steps" spans, whose
// trace is then cleared (it is on only for them).
double take_host_wait_ms(fsdp::FullyShardedBase& wrapped) {
  int64_t us = 0;
  for (const auto& span : wrapped.trace_spans())
    if (span.name == "host_steps") us += span.end_us - span.begin_us;
  wrapped.clear_trace();
  return static_cast<double>(us) / 1e3;
}

std::string text_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return fsdp::tools::error_text(*c);
  return e.what();
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') out += '\\', out += ch;
    else if (c == '\n') out += "\\n";
    else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else out += ch;
  }
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string list(const std::vector<double>& v, const char* fmt) {
  std::string s;
  char b[32];
  for (double x : v) {
    std::snprintf(b, sizeof b, fmt, x);
    s += (s.empty() ? "" : ", ") + std::string(b);
  }
  return "[" + s + "]";
}

// Empty when the flags make sense together, else why not.
std::string check_args(const Args& a) {
  if (a.width % a.heads != 0) return "--width must be a multiple of --heads";
  if (a.modes.empty()) return "--modes needs plain and/or fsdp";
  for (const auto& m : a.modes)
    if (m != "plain" && m != "fsdp" && m != "offload" && m != "offload_auto")
      return "--modes takes plain, fsdp, offload and/or offload_auto, got '" + m + "'";
  if (!(a.gpu_margin_mem_ratio > 0 && a.gpu_margin_mem_ratio <= 1))
    return "--gpu-margin-mem-ratio must be in (0, 1]";
  for (size_t i = 0; i < a.modes.size(); ++i)
    if (std::count(a.modes.begin(), a.modes.end(), a.modes[i]) > 1) return "--modes names '" + a.modes[i] + "' twice";
  if (a.reduce_dtype != "fp32" && a.reduce_dtype != "bf16")
    return "--reduce-dtype must be fp32 or bf16, got '" + a.reduce_dtype + "'";
  return "";
}

int run(const Args& a) {
  // The offload modes' traces (cleared every step; written when their model goes), removed at the end.
  const std::string trace_dir =
      (std::filesystem::temp_directory_path() / ("bench_gpu_gpt_trace." + std::to_string(getpid()))).string();
  const bool want_fsdp = std::any_of(a.modes.begin(), a.modes.end(), [](const std::string& k) { return k != "plain"; });

  std::vector<std::unique_ptr<Mode>> modes;
  for (const auto& k : a.modes) {
    auto m = std::make_unique<Mode>();
    m->key = k;
    m->name = k == "plain"     ? "PLAIN"
              : k == "fsdp"    ? "FULL_SHARD"
              : k == "offload" ? "FULL_SHARD_OFFLOAD"
                               : "FULL_SHARD_OFFLOAD_AUTO";
    modes.push_back(std::move(m));
  }
  auto mode_of = [&](const std::string& k) -> Mode* {
    for (auto& m : modes)
      if (m->key == k) return m.get();
    return nullptr;
  };

  // One rank, NCCL, a file store (no TCP port to collide with): the device comes from the group.
  fsdp::comm::ProcessGroup pg;
  Dev dev;
  dev.cuda = !a.cpu;
  std::string backend = "-";
  if (want_fsdp) {
    try {
      fsdp::comm::LaunchOverrides one;
      one.rank = 0;
      one.world_size = 1;
      one.local_rank = 0;
      one.local_world_size = 1;
      const std::string store = "/tmp/bench_gpu_gpt." + std::to_string(::getpid()) + ".store";
      std::remove(store.c_str());
      pg = fsdp::comm::init_process_group(
          fsdp::comm::InitOptions()
              .backend(dev.cuda ? fsdp::comm::Backend::kNccl : fsdp::comm::Backend::kAuto)
              .file_store_path(store)
              .overrides(one));
      if (dev.cuda) {
        dev.index = pg.cuda_device();
        backend = pg.cuda_backend() == fsdp::comm::Backend::kNccl ? "nccl" : "gloo";
      } else {
        backend = "gloo";
      }
    } catch (const std::exception& e) {
      for (auto& m : modes)
        if (m->sharded()) m->error = "init_process_group: " + text_of(e);
    }
  }
  use_device(dev);
  const torch::Device device = dev.cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dev.index))
                                       : torch::Device(torch::kCPU);
  const auto fp32 = torch::TensorOptions().device(device).dtype(torch::kFloat);

  // The data every mode trains on, in the same order.
  torch::manual_seed(1234);
  auto tokens = torch::randint(0, a.vocab, {a.batches, a.batch, a.seq + 1}, torch::TensorOptions().device(device).dtype(torch::kLong));
  std::vector<torch::Tensor> xs, ys;
  for (int i = 0; i < a.batches; ++i) {
    xs.push_back(tokens[i].narrow(1, 0, a.seq).contiguous());
    ys.push_back(tokens[i].narrow(1, 1, a.seq).contiguous());
  }
  sync(dev);
  const int64_t base = allocated_now(dev);

  // Builds, in the modes' order; each one's footprint measured as the allocator's growth.
  auto total_footprints = [&] {
    int64_t s = 0;
    for (auto& m : modes) s += m->footprint;
    return s;
  };
  for (auto& m : modes) {
    if (!m->error.empty()) continue;
    try {
      torch::manual_seed(0);  // the same initial weights in every mode
      Gpt model(a, fp32);     // on the rank's GPU before wrapping
      for (const auto& p : model->parameters()) m->params += p.numel();
      if (m->key == "plain") {
        m->plain = model;
        m->opt = std::make_unique<FusedAdam>(model->parameters(), a.lr);
      } else {
        auto mp = fsdp::MixedPrecision().param_dtype(torch::kBFloat16).reduce_dtype(
            a.reduce_dtype == "fp32" ? torch::kFloat : torch::kBFloat16);
        auto opts = fsdp::Options()
                        .sharding_strategy(fsdp::ShardingStrategy::kFullShard)
                        .auto_wrap_policy(fsdp::module_type_policy<BlockImpl>())
                        .mixed_precision(mp)
                        .forward_prefetch(a.forward_prefetch);
        const bool offload = m->offloaded();
        if (offload) opts.cpu_offload(true).optimizer_in_backward(true);
        if (m->key == "offload_auto") opts.gpu_margin_mem_ratio(a.gpu_margin_mem_ratio);
        if (offload) opts.trace_dir(trace_dir);
        m->wrapped = fsdp::FullyShardedDataParallel<GptImpl>(model, pg, opts);
        model = nullptr;
        m->units = static_cast<int64_t>(m->wrapped->unit_paths().size());
        if (offload) {
          // CPUAdam's defaults are Adam's (betas 0.9/0.999, eps 1e-8, no weight decay).
          m->host_opt = std::make_unique<fsdp::optim::CPUAdam>(m->wrapped->parameters(), fsdp::optim::CPUAdamOptions(a.lr));
          m->wrapped->register_optimizer_in_backward(*m->host_opt);
        } else {
          m->opt = std::make_unique<FusedAdam>(m->wrapped->parameters(), a.lr);
        }
      }
      sync(dev);
      m->footprint = allocated_now(dev) - base - total_footprints();
    } catch (const std::exception& e) {
      m->error = "construction: " + text_of(e);
      m->release();
      release_cached(dev);
    }
  }

  // Collectives, counted during the timed steps only.
  // Into the mode whose timed steps are running (nullptr: not counting).
  std::atomic<Counts*> counting{nullptr};
  const int observer = fsdp::comm::detail::add_collective_observer(
      [&](const fsdp::comm::ProcessGroup&, const fsdp::comm::detail::CollectiveCall& c) {
        Counts* into = counting.load(std::memory_order_relaxed);
        if (into == nullptr) return;
        Counts& counts = *into;
        using Op = fsdp::comm::detail::CollectiveOp;
        switch (c.op) {
          case Op::AllGather: ++counts.all_gather; break;
          case Op::ReduceScatter: ++counts.reduce_scatter; break;
          case Op::AllReduce: ++counts.all_reduce; break;
          default: ++counts.other; break;
        }
        counts.bytes += c.numel() * static_cast<int64_t>(c10::elementSize(c.dtype()));
      });

  const int64_t tokens_per_step = a.batch * a.seq;
  auto step = [&](Mode& m) {
    m.clear_grads();
    const int64_t i = m.next_batch++ % a.batches;
    auto logits = m.forward(xs[i]);
    auto loss = at::cross_entropy_loss(logits.reshape({-1, a.vocab}).to(at::kFloat), ys[i].reshape({-1}));
    loss.backward();
    m.step_optimizer();
    return loss.detach();
  };

  std::string device_error;
  for (int round = 0; round < a.rounds; ++round) {
    for (auto& mp : modes) {
      Mode& m = *mp;
      if (!m.alive()) continue;
      try {
        for (int w = 0; w < a.warmup; ++w) m.losses.push_back(step(m).item<double>());
        if (m.offloaded()) m.wrapped->clear_trace();
        sync(dev);
        reset_peak(dev);
        const int64_t casts0 = g_casts.load();
        counting = m.sharded() ? &m.counts : nullptr;
        std::vector<double> this_round;
        for (int s = 0; s < a.steps; ++s) {
          sync(dev);
          const auto t0 = std::chrono::steady_clock::now();
          auto loss = step(m);
          sync(dev);
          const auto t1 = std::chrono::steady_clock::now();
          this_round.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
          if (m.offloaded()) m.host_wait_ms.push_back(take_host_wait_ms(*m.wrapped));
          m.losses.push_back(loss.item<double>());
        }
        counting = nullptr;
        m.casts += g_casts.load() - casts0;
        m.timed_steps += a.steps;
        const int64_t others = total_footprints() - m.footprint;
        const int64_t peak = allocated_peak(dev);
        if (peak > m.peak_raw) {
          m.peak_raw = peak;
          m.other_bytes = others;
          m.peak_alone = peak - others;
        }
        m.ms.insert(m.ms.end(), this_round.begin(), this_round.end());
        m.round_ms.push_back(this_round);
        // Between phases a mode holds its parameters and Adam state only: no gradients,
        // no cached transient buffers (FSDP's empty_cache).
        m.clear_grads();
        if (m.wrapped) m.wrapped->empty_cache();
        sync(dev);
        m.footprint = allocated_now(dev) - base - others;
      } catch (const std::exception& e) {
        counting = nullptr;
        m.error = "round " + std::to_string(round) + ": " + text_of(e);
        m.footprint = 0;
        // The other modes go on, unless the device itself failed: then every mode stops and
        // what was measured is reported.
        try {
          m.release();
          sync(dev);
          release_cached(dev);
        } catch (const std::exception& e2) {
          device_error = text_of(e2);
        }
      }
      if (!device_error.empty()) break;
    }
    if (!device_error.empty()) {
      for (auto& other : modes)
        if (other->error.empty()) other->error = "stopped: the device failed: " + device_error;
      break;
    }
  }
  fsdp::comm::detail::remove_collective_observer(observer);

  // ---- report ----
  const std::string gpu = device_name(dev);
  const double gib = 1.0 / (1 << 30);
  Mode* plain = mode_of("plain");
  Mode* fsdp_mode = mode_of("fsdp");
  for (auto& mp : modes) {
    const Mode& m = *mp;
    if (m.ms.empty()) {
      std::printf("%-18s failed: %s\n", m.name.c_str(), m.error.c_str());
      continue;
    }
    const double ms = median(m.ms);
    std::printf("%-18s %8.1f ms/step  %8.0f tokens/s  peak %.2f GiB (raw %.2f GiB)%s%s\n", m.name.c_str(), ms,
                tokens_per_step / (ms * 1e-3), m.peak_alone * gib, m.peak_raw * gib, m.error.empty() ? "" : "  error: ",
                m.error.c_str());
  }
  auto loss_diff = [&](const Mode& m) {
    double d = 0;
    if (!plain || plain == &m) return d;
    const size_t n = std::min(plain->losses.size(), m.losses.size());
    for (size_t i = 0; i < n; ++i) d = std::max(d, std::fabs(plain->losses[i] - m.losses[i]));
    return d;
  };
  for (auto& mp : modes) {
    const Mode& m = *mp;
    std::ostringstream j;
    char b[1024];
    std::snprintf(b, sizeof b,
                  "{\"bench\": \"gpu_gpt\", \"model\": \"gpt\", \"strategy\": \"%s\", \"world_size\": 1, "
                  "\"device\": \"%s\", \"params\": %lld, \"layers\": %lld, \"width\": %lld, \"heads\": %lld, "
                  "\"vocab\": %lld, \"batch\": %lld, \"seq\": %lld, \"tokens_per_step\": %lld, "
                  "\"param_dtype\": \"bf16\", \"master_dtype\": \"fp32\", \"optimizer\": \"%s\", \"embedding\": \"tied\"",
                  m.name.c_str(), json_escape(gpu).c_str(), (long long)m.params, (long long)a.layers,
                  (long long)a.width, (long long)a.heads, (long long)a.vocab, (long long)a.batch, (long long)a.seq,
                  (long long)tokens_per_step, m.offloaded() ? "cpu_adam_in_backward" : "fused_adam");
    j << b;
    if (m.sharded()) j << ", \"reduce_dtype\": \"" << a.reduce_dtype << "\", \"backend\": \"" << backend << "\"";
    if (!m.ms.empty()) {
      const double ms = median(m.ms);
      double sum = 0;
      for (double x : m.ms) sum += x;
      std::vector<double> per_round;
      for (const auto& r : m.round_ms) per_round.push_back(median(r));
      std::snprintf(b, sizeof b,
                    ", \"step_ms\": %.3f, \"step_ms_min\": %.3f, \"step_ms_mean\": %.3f, \"tokens_per_s\": %.1f, "
                    "\"samples_per_s\": %.2f, \"timed_steps\": %lld, \"peak_bytes\": %lld, "
                    "\"peak_allocated_bytes\": %lld, \"other_mode_bytes\": %lld, \"casts_per_step\": %.1f",
                    ms, *std::min_element(m.ms.begin(), m.ms.end()), sum / m.ms.size(), tokens_per_step / (ms * 1e-3),
                    a.batch / (ms * 1e-3), (long long)m.timed_steps, (long long)m.peak_alone, (long long)m.peak_raw,
                    (long long)m.other_bytes, static_cast<double>(m.casts) / m.timed_steps);
      j << b << ", \"step_ms_per_round\": " << list(per_round, "%.3f");
      if (m.sharded()) {
        const double k = 1.0 / m.timed_steps;
        std::snprintf(b, sizeof b,
                      ", \"units\": %lld, \"all_gathers_per_step\": %.1f, \"reduce_scatters_per_step\": %.1f, "
                      "\"all_reduces_per_step\": %.1f, \"other_collectives_per_step\": %.1f, "
                      "\"collective_bytes_per_step\": %.0f, \"max_loss_diff_vs_plain\": %.6f",
                      (long long)m.units, m.counts.all_gather * k, m.counts.reduce_scatter * k,
                      m.counts.all_reduce * k, m.counts.other * k, m.counts.bytes * k, loss_diff(m));
        j << b;
        if (m.offloaded() && m.wrapped) j << ", \"units_on_device\": " << m.wrapped->units_placed_on_device().size();
        if (!m.host_wait_ms.empty()) {
          double wait = 0, total = 0;
          for (double x : m.host_wait_ms) wait += x;
          for (double x : m.ms) total += x;
          std::snprintf(b, sizeof b, ", \"host_wait_ms\": %.3f, \"gpu_waits_for_host_share\": %.4f",
                        median(m.host_wait_ms), wait / total);
          j << b;
        }
      }
      j << ", \"losses\": " << list(m.losses, "%.5f");
    }
    if (!m.error.empty()) j << ", \"error\": \"" << json_escape(m.error) << "\"";
    j << "}";
    std::printf("%s\n", j.str().c_str());
  }
  if (plain && fsdp_mode && !plain->ms.empty() && !fsdp_mode->ms.empty()) {
    std::vector<double> per_round;
    const size_t n = std::min(plain->round_ms.size(), fsdp_mode->round_ms.size());
    for (size_t r = 0; r < n; ++r) per_round.push_back(median(plain->round_ms[r]) / median(fsdp_mode->round_ms[r]));
    std::printf("{\"bench\": \"gpu_gpt\", \"target\": \"full_shard_vs_plain\", \"goal\": 0.95, \"ratio\": %.3f, "
                "\"ratio_per_round\": %s, \"median_ratio\": %.3f}\n",
                median(plain->ms) / median(fsdp_mode->ms), list(per_round, "%.3f").c_str(), median(per_round));
  }
  std::fflush(stdout);
  bool failed = false;
  for (auto& m : modes) failed = failed || !m->error.empty();
  for (auto& m : modes) m->release();
  std::error_code ignored;
  std::filesystem::remove_all(trace_dir, ignored);
  return failed ? 1 : 0;
}

void tiny(Args& a, const CLI::App& app) {
  // A configuration small enough for any GPU, for smoke tests: explicit flags still win.
  auto set = [&](const char* flag, int64_t& v, int64_t x) {
    if (app.count(flag) == 0) v = x;
  };
  set("--layers", a.layers, 2);
  set("--width", a.width, 128);
  set("--heads", a.heads, 4);
  set("--vocab", a.vocab, 1000);
  set("--batch", a.batch, 2);
  set("--seq", a.seq, 64);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bool tiny_config = false;
  CLI::App app{"bench_gpu_gpt: a ~1.3B GPT on one GPU, plain libtorch against FSDP FULL_SHARD at one rank (NCCL)"};
  const auto positive = CLI::Range(1, 1 << 30);
  const auto non_negative = CLI::Range(0, 1 << 30);
  app.add_option("--layers", a.layers, "transformer blocks")->capture_default_str()->check(positive);
  app.add_option("--width", a.width, "model width")->capture_default_str()->check(positive);
  app.add_option("--heads", a.heads, "attention heads")->capture_default_str()->check(positive);
  app.add_option("--vocab", a.vocab, "vocabulary")->capture_default_str()->check(positive);
  app.add_option("--batch", a.batch, "sequences per step")->capture_default_str()->check(positive);
  app.add_option("--seq", a.seq, "tokens per sequence")->capture_default_str()->check(positive);
  app.add_option("--steps", a.steps, "timed steps per phase")->capture_default_str()->check(positive);
  app.add_option("--warmup", a.warmup, "untimed steps before each phase's timed ones")->capture_default_str()->check(non_negative);
  app.add_option("--rounds", a.rounds, "phases per mode, alternating")->capture_default_str()->check(positive);
  app.add_option("--batches", a.batches, "distinct data batches, used in turn")->capture_default_str()->check(positive);
  app.add_option("--modes", a.modes, "plain, fsdp, offload and/or offload_auto, in the order of each round")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--gpu-margin-mem-ratio", a.gpu_margin_mem_ratio,
                 "offload_auto: the fraction of the GPU's free margin that takes units back after the first step")
      ->capture_default_str();
  app.add_option("--reduce-dtype", a.reduce_dtype, "FSDP's MixedPrecision reduce_dtype: fp32 or bf16")->capture_default_str();
  app.add_flag("--forward-prefetch", a.forward_prefetch, "FSDP Options::forward_prefetch");
  app.add_option("--lr", a.lr, "Adam learning rate")->capture_default_str();
  app.add_flag("--tiny", tiny_config, "a tiny model (2 blocks, width 128, 4 heads, vocabulary 1000, batch 2 x 64) for smoke tests");
  app.add_flag("--cpu", a.cpu,
               "run on the CPU instead (FSDP over Gloo): a smoke test of this program without a GPU; "
               "its times mean nothing and its memory figures are 0");
  CLI11_PARSE(app, argc, argv);
  if (tiny_config) tiny(a, app);
  if (const std::string why = check_args(a); !why.empty()) {
    fsdp::tools::print_error(kName, why + " (--help lists the flags)");
    return 2;
  }

  if (!a.cpu) {
#ifndef FSDP_BENCH_CUDA
    std::printf("%s (this build's libtorch has no CUDA)\n", kNoGpu);
    std::printf("{\"bench\": \"gpu_gpt\", \"skipped\": \"libtorch without CUDA\"}\n");
    return 0;
#else
    if (!torch::cuda::is_available()) {
      std::printf("%s\n", kNoGpu);
      std::printf("{\"bench\": \"gpu_gpt\", \"skipped\": \"no CUDA device\"}\n");
      return 0;
    }
#endif
  }
  try {
    return run(a);
  } catch (const c10::Error& e) {
    fsdp::tools::print_exception(kName, e, "FAILED: ");
  } catch (const std::exception& e) {
    fsdp::tools::print_exception(kName, e, "FAILED: ");
  }
  return 1;
}
