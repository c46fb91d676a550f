// bench_strategies: step time, traffic and memory of every sharding strategy on two
// models, against Python PyTorch DDP measured in the same run (not a test).
//
// Usage:
//   bench_strategies [--steps 30] [--warmup 5] [--models mlp,transformer] [--no-python]
//                    [--cpu-adam] [--repeat 2] [--zero-targets | --peers] [--rounds 1]
//                    (rank mode also: --bucket-mb MB,
//                    --prefetch none|default|fwd)
//
// --repeat R runs every configuration, Python's included, R times in rounds (each
// round runs them all in turn, odd rounds in the reverse order). Ratios between rows
// are taken within a round, where load that comes and goes on this shared machine hits
// both alike, and reported as the median and range over rounds; the table's absolute
// columns are each row's fastest run. Every row times one window of --steps after
// --warmup, as Python's do (--rounds R gives the C++ rows R windows, the fastest kept).
// Prefetch: "default" is the library's default (backward_prefetch BACKWARD_PRE), "none"
// turns it off, "fwd" adds forward_prefetch.
//
// Without RANK in the environment it re-executes itself under the fsdp-run next to
// it once per (model, strategy): NO_SHARD, SHARD_GRAD_OP, FULL_SHARD at N=2 and
// HYBRID_SHARD (shard groups of 2) at N=4, NO_SHARD, FULL_SHARD and HYBRID_SHARD also
// with gradient buckets (bucket_cap_mb 25; FULL_SHARD also 4); with --cpu-adam also NO_SHARD and
// FULL_SHARD with fsdp::optim::CPUAdam; ZERO1 and ZERO2 (the model unwrapped,
// fsdp::optim::ZeroRedundancyOptimizer with default options) with Adam, and ZERO2 with
// CPUAdam under --cpu-adam. Then it runs bench/ddp_baseline.py under $FSDP_PYTHON (default:
// the Python whose torch wheel the build links) at N=2 on the same model, batch, optimizer
// and thread count (one per rank): plain DDP, DDP + torch.distributed.optim.ZeroRedundancyOptimizer,
// and FSDP2 (fully_shard per unit and root on a CPU mesh, Gloo), whose samples/s the
// FULL_SHARD rows are compared with at the end, over shared memory and over Gloo/TCP
// (FSDP_SHARED_MEMORY=0, FSDP2's transport). --zero-targets runs only
// the rows the ZeRO speed targets compare (NO_SHARD+CPUAdam, ZERO2+CPUAdam, ZERO1,
// ZERO2, ZERO2 with overlap_communication, the ZeRO rows also over Gloo/TCP, Python ZeRO);
// --peers only FULL_SHARD (both transports), NO_SHARD over Gloo/TCP, Python DDP and FSDP2.
// It prints a table, one JSON object per row, then each target's ratio per round. Rank mode runs under any
// launcher, also across hosts (`fsdp-run --nnodes 2 ... --nproc 2 -- bench_strategies --model
// mlp --strategy hybrid_shard --shard-group 2 --optim adam`, bench/measure_multihost.sh):
// rank 0 prints that configuration's JSON line.
//
// Models: "mlp" 784-1024-1024-10 (ReLU), one unit per Linear; "transformer" Linear
// 784->256, 4 blocks [x + mix(LayerNorm(x)); x + fc2(GELU(fc1(x)))] with fc1 256->1024,
// Linear 256->10, one unit per block and per projection. Adam (lr 1e-3), cross
// entropy, global batch 128 split evenly, 1 intra-op thread per rank.
//
// Measured per configuration: step_ms = (slowest rank's wall time for `steps` steps
// between two barriers) / steps; bytes_communicated = bytes this rank sent through
// fsdp::comm per step (comm_counters; rank 0); param/grad/optim bytes on rank 0 after
// the run (memory_stats and the optimizer's exp_avg/exp_avg_sq); peak_rss_bytes =
// rank 0's ru_maxrss. ring_optimum_bytes is the per-rank ring optimum for the
// strategy (2Psi(N-1)/N for NO_SHARD and SHARD_GRAD_OP, 3Psi(N-1)/N for FULL_SHARD;
// HYBRID: 3Psi(g-1)/g in the shard group plus 2(Psi/g)(R-1)/R across the R replicas).
//
// Against the compute ceiling (bench/compute_ceiling.h), in the same rank processes:
// ceiling_ms = the unwrapped model's forward + backward on this rank's slice with every
// rank at once, alternated with the step in --rounds rounds (fastest of each kept);
// attainable_ms = ceiling + the optimizer over the parameters this rank owns + one copy
// of bytes_communicated at the memcpy bandwidth measured with every rank copying.
// Rows with FSDP_SHARED_MEMORY=0 ("+gloo-tcp") show the cross-host transport.
// --breakdown prints the step's phases beside the plain model's; --only step|ceiling
// runs one loop for a profiler (docs/benchmarks.md).

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/optim/cpu_adam.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "bench_launch.h"
#include "comm/collective_call.h"
#include "compute_ceiling.h"

#ifndef FSDP_SOURCE_DIR
#define FSDP_SOURCE_DIR "."
#endif
#ifndef FSDP_PYTHON_EXECUTABLE
#define FSDP_PYTHON_EXECUTABLE "python3"
#endif

namespace {

struct Args {
  int steps = 30, warmup = 5;
  std::vector<std::string> models{"mlp", "transformer"};
  bool python = true, cpu_adam = false;
  bool zero_targets = false;  // launcher: only the rows the ZeRO targets compare
  bool peers = false;         // launcher: only the rows compared with Python DDP and FSDP2
  bool zero_overlap = false;  // rank mode, zero1/zero2: ZeroOptions::overlap_communication
  // rank mode
  std::string model = "mlp", strategy = "no_shard", optim = "adam", prefetch = "default";
  int repeat = 2;
  int rounds = 2;  // rank mode: alternations of ceiling and step
  bool rounds_given = false;  // launcher: --rounds forwarded; otherwise 1, Python's single window
  std::string only;  // rank mode, for profilers: "step" or "ceiling" runs just that loop
  bool breakdown = false;  // rank mode: also time the step's phases against the plain ones
  int shard_group = 0;
  double bucket_mb = 0;  // Options::bucket_cap_mb
  bool in_backward = false;  // rank mode: Options::optimizer_in_backward
  bool zero_copy = false;    // rank mode: Options::zero_copy_gather
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

const char* kUsage =
    "usage: bench_strategies [--steps 30] [--warmup 5] [--models mlp,transformer] [--no-python]\n"
    "                        [--cpu-adam] [--repeat 2] [--zero-targets | --peers] [--rounds 1]\n"
    "  rank mode (set by the launcher): --model M --strategy S --optim O --prefetch none|default|fwd\n"
    "                                   --shard-group G --bucket-mb MB [--rounds 2] [--only step|ceiling]\n"
    "                                   [--breakdown] [--zero-overlap] [--optimizer-in-backward]\n"
    "                                   [--zero-copy-gather]\n";

[[noreturn]] void usage_error(const std::string& why) {
  fsdp::tools::print_error("bench_strategies", why + "\n" + kUsage);
  std::exit(2);
}

// A number for `flag`, or a usage error naming it.
template <typename T>
T number(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    const double x = std::stod(v, &used);
    if (used == v.size() && x >= 0) return static_cast<T>(x);
  } catch (const std::exception&) {
  }
  usage_error(flag + " expects a non-negative number, got '" + v + "'");
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "-h" || k == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(k + " needs a value");
      return argv[++i];
    };
    if (k == "--steps") a.steps = number<int>(k, next());
    else if (k == "--warmup") a.warmup = number<int>(k, next());
    else if (k == "--models") a.models = split(next());
    else if (k == "--no-python") a.python = false;
    else if (k == "--cpu-adam") a.cpu_adam = true;
    else if (k == "--zero-targets") a.zero_targets = true;
    else if (k == "--peers") a.peers = true;
    else if (k == "--zero-overlap") a.zero_overlap = true;
    else if (k == "--model") a.model = next();
    else if (k == "--strategy") a.strategy = next();
    else if (k == "--optim") a.optim = next();
    else if (k == "--prefetch") a.prefetch = next();
    else if (k == "--repeat") a.repeat = number<int>(k, next());
    else if (k == "--rounds") {
      a.rounds = number<int>(k, next());
      a.rounds_given = true;
    }
    else if (k == "--only") a.only = next();
    else if (k == "--breakdown") a.breakdown = true;
    else if (k == "--shard-group") a.shard_group = number<int>(k, next());
    else if (k == "--bucket-mb") a.bucket_mb = number<double>(k, next());
    else if (k == "--optimizer-in-backward") a.in_backward = true;
    else if (k == "--zero-copy-gather") a.zero_copy = true;
    else usage_error("unknown argument '" + k + "'");
  }
  return a;
}

// ---- models (same as bench/ddp_baseline.py) ----

struct BenchBlockImpl : torch::nn::Module {
  explicit BenchBlockImpl(int64_t dim) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    mix = register_module("mix", torch::nn::Linear(dim, dim));
    fc1 = register_module("fc1", torch::nn::Linear(dim, 4 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + mix->forward(norm->forward(x));
    return x + fc2->forward(torch::gelu(fc1->forward(x)));
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear mix{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(BenchBlock);

torch::nn::Sequential make_model(const std::string& name) {
  torch::manual_seed(0);
  if (name == "mlp")
    return torch::nn::Sequential(torch::nn::Linear(784, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024),
                                 torch::nn::ReLU(), torch::nn::Linear(1024, 10));
  torch::nn::Sequential s(torch::nn::Linear(784, 256));
  for (int i = 0; i < 4; ++i) s->push_back(BenchBlock(256));
  s->push_back(torch::nn::Linear(256, 10));
  return s;
}

// ---- rank mode ----

int rank_main(const Args& a) {
  at::set_num_threads(1);
  auto pg = fsdp::comm::init_process_group();
  const int n = pg.size();
  const int64_t global_batch = 128, per = global_batch / n;
  // zero1 / zero2: the model unwrapped, fsdp::optim::ZeroRedundancyOptimizer (default
  // options: 1M-element buckets, stage 1 all-reduce variant); the FSDP fields below then
  // describe no wrapper.
  const int zero_stage = a.strategy == "zero1" ? 1 : a.strategy == "zero2" ? 2 : 0;
  if (zero_stage && a.breakdown) usage_error("--breakdown times FSDP units; it does not apply to --strategy " + a.strategy);
  auto strategy = zero_stage ? fsdp::ShardingStrategy::kNoShard : fsdp::parse_sharding_strategy(a.strategy);
  auto opts = fsdp::Options().sharding_strategy(strategy).auto_wrap_policy(fsdp::always_wrap_policy());
  if (a.shard_group > 0) opts.shard_group_size(a.shard_group);
  if (a.prefetch == "none") opts.backward_prefetch(fsdp::BackwardPrefetch::kNone);
  else if (a.prefetch == "fwd") opts.forward_prefetch(true);
  else if (a.prefetch != "default") {
    std::fprintf(stderr, "bench_strategies: --prefetch must be none, default or fwd, got %s\n", a.prefetch.c_str());
    std::exit(2);
  }
  opts.bucket_cap_mb(a.bucket_mb);
  if (a.in_backward && zero_stage) usage_error("--optimizer-in-backward applies to the FSDP strategies");
  opts.optimizer_in_backward(a.in_backward);
  if (a.zero_copy && zero_stage) usage_error("--zero-copy-gather applies to the FSDP strategies");
  opts.zero_copy_gather(a.zero_copy);
  fsdp::FullyShardedDataParallel<torch::nn::SequentialImpl> model{nullptr};
  torch::nn::Sequential unwrapped{nullptr};
  int64_t numel = 0;
  {
    auto ref = make_model(a.model);
    for (auto& p : ref->parameters()) numel += p.numel();
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  fsdp::optim::ZeroRedundancyOptimizer* zero = nullptr;
  if (zero_stage) {
    unwrapped = make_model(a.model);
    namespace zo = fsdp::optim;
    auto inner = a.optim == "cpuadam" ? zo::inner_optimizer<zo::CPUAdam>(zo::CPUAdamOptions(1e-3))
                                      : zo::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3));
    auto z = std::make_unique<zo::ZeroRedundancyOptimizer>(
        unwrapped->parameters(), inner,
        zo::ZeroOptions().process_group(pg).stage(zero_stage).module(unwrapped.ptr()).overlap_communication(
            a.zero_overlap));
    zero = z.get();
    opt = std::move(z);
  } else {
    model = fsdp::FullyShardedDataParallel(make_model(a.model), pg, opts);
    if (a.optim == "cpuadam") opt = std::make_unique<fsdp::optim::CPUAdam>(model->parameters(), fsdp::optim::CPUAdamOptions(1e-3));
    else opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
    if (a.in_backward) model->register_optimizer_in_backward(*opt);
  }
  auto forward = [&](const torch::Tensor& in) { return zero ? unwrapped->forward(in) : model->forward(in); };
  // ZeroRedundancyOptimizer::zero_grad hides the base class's (not virtual in libtorch).
  auto clear_grads = [&] { zero ? zero->zero_grad(/*set_to_none=*/true) : opt->zero_grad(/*set_to_none=*/false); };
  auto gen = at::detail::createCPUGenerator(1 + pg.rank());
  auto x = at::randn({per, 784}, gen);
  auto y = at::randint(0, 10, {per}, gen, torch::kLong);
  auto step = [&] {
    clear_grads();
    torch::nn::functional::cross_entropy(forward(x), y).backward();
    opt->step();
  };
  // The compute ceiling: the same model unwrapped, forward + backward of this
  // rank's slice, every rank at once (bench/compute_ceiling.h).
  fsdp::bench::PlainComputeProbe plain(make_model(a.model), x, y);
  for (int i = 0; i < a.warmup; ++i) {
    step();
    plain.step();
  }
  if (!a.only.empty()) {
    // For a profiler attached to the rank (perf record, callgrind): one loop, no report.
    if (a.only != "step" && a.only != "ceiling") usage_error("--only expects step or ceiling, got '" + a.only + "'");
    const double ms = a.only == "step" ? fsdp::bench::timed_together_ms(pg, a.steps, step) : plain.ms(pg, a.steps);
    if (pg.rank() == 0) std::printf("%s: %.3f ms per step\n", a.only.c_str(), ms);
    return 0;
  }
  // Rounds alternate the ceiling and the step, each keeping its fastest round:
  // load that comes and goes on a shared machine hits both alike.
  double step_ms = 0, ceiling_ms = 0;
  int64_t bytes = 0;
  // Collectives this rank issues per step (what the flight recorder records: bench_flight_recorder).
  int64_t calls = 0;
  const int counting = fsdp::comm::detail::add_collective_observer(
      [&calls](const fsdp::comm::ProcessGroup&, const fsdp::comm::detail::CollectiveCall&) { ++calls; });
  for (int round = 0; round < std::max(1, a.rounds); ++round) {
    const double c = plain.ms(pg, a.steps);
    fsdp::comm::barrier(pg);
    fsdp::comm::comm_counters().reset();
    if (round == 0) calls = 0;
    const double s = fsdp::bench::timed_together_ms(pg, a.steps, step);
    bytes = fsdp::comm::comm_counters().total() / a.steps;
    if (round == 0) fsdp::comm::detail::remove_collective_observer(counting);
    ceiling_ms = round == 0 ? c : std::min(ceiling_ms, c);
    step_ms = round == 0 ? s : std::min(step_ms, s);
  }
  const double step_s = step_ms * 1e-3;
  fsdp::MemoryStats mem{};
  int64_t optim_bytes = 0;
  if (zero) {
    const auto u = zero->get_memory_usage();
    mem.param_shard_bytes = u[fsdp::MemoryCategory::kParameterShards];
    mem.grad_shard_bytes = u[fsdp::MemoryCategory::kGradients];
    optim_bytes = u[fsdp::MemoryCategory::kOptimizerState];
  } else {
    mem = model->memory_stats();
    for (const auto& kv : opt->state()) {
      auto* s = dynamic_cast<torch::optim::AdamParamState*>(kv.second.get());
      if (!s) continue;
      for (const auto* t : {&s->exp_avg(), &s->exp_avg_sq()})
        if (t->defined()) optim_bytes += t->numel() * int64_t(t->element_size());
    }
  }
  // The attainable bound: ceiling + this rank's optimizer over the parameters it
  // owns (the flat shard; all of them for NO_SHARD) + one copy of every byte
  // its collectives moved, at the memcpy bandwidth of all ranks copying at once.
  const int64_t owned_numel = zero ? zero->partition_numel() : mem.param_shard_bytes / int64_t(sizeof(float));
  const double optimizer_ms = fsdp::bench::optimizer_step_ms(pg, a.optim, owned_numel, a.steps);
  const double memcpy_bps = fsdp::bench::memcpy_bytes_per_s(pg, int64_t(4) << 20, int64_t(64) << 20);
  const double copy_ms = bytes / memcpy_bps * 1e3;
  const double attainable_ms = ceiling_ms + optimizer_ms + copy_ms;
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  // The same bytes copied at the bandwidth of blocks out of cache (2 MiB, a shard of
  // the mlp's larger unit, after walking 64 MiB): the step's copies mostly are, since
  // a rank's working set exceeds the shared L3. Reported beside the bound, not in it;
  // measured after the peak RSS is read (its 64 MiB are not the step's).
  const double uncached_bps = fsdp::bench::memcpy_uncached_bytes_per_s(pg, int64_t(2) << 20, int64_t(64) << 20, 20);
  const double copy_uncached_ms = bytes / uncached_bps * 1e3;
  const double psi = 4.0 * numel;
  double optimum = 0;
  const int g = strategy == fsdp::ShardingStrategy::kHybridShard ? (a.shard_group > 0 ? a.shard_group : n) : n;
  const int r = n / g;
  switch (strategy) {
    case fsdp::ShardingStrategy::kNoShard:
    case fsdp::ShardingStrategy::kShardGradOp: optimum = 2 * psi * (n - 1) / n; break;
    case fsdp::ShardingStrategy::kFullShard: optimum = 3 * psi * (n - 1) / n; break;
    case fsdp::ShardingStrategy::kHybridShard:
      optimum = 3 * psi * (g - 1) / g + 2 * (psi / g) * (r - 1) / r;
      break;
  }
  // [Note: ZeRO partition layout]: stage 2 2Ψ, stage 1 (all-reduce variant) 3Ψ.
  if (zero_stage) optimum = (zero_stage == 1 ? 3 : 2) * psi * (n - 1) / n;
  if (a.breakdown) {
    // The step's phases beside the plain model's, every rank at once: what FSDP adds
    // to forward (gathers, hooks, views) and to backward (gathers, flattening,
    // reductions, hooks), and the optimizer. Rank 0's means, after the rounds above.
    using clock = std::chrono::steady_clock;
    auto ms_since = [](clock::time_point t) { return std::chrono::duration<double, std::milli>(clock::now() - t).count(); };
    double zero = 0, fwd = 0, bwd = 0, optim = 0, plain_zero = 0, plain_fwd = 0, plain_bwd = 0;
    model->clear_trace();  // with FSDP_TRACE set: the spans of these steps only
    fsdp::comm::barrier(pg);
    for (int i = 0; i < a.steps; ++i) {
      auto t = clock::now();
      opt->zero_grad(/*set_to_none=*/false);
      zero += ms_since(t);
      t = clock::now();
      auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
      fwd += ms_since(t);
      t = clock::now();
      loss.backward();
      bwd += ms_since(t);
      t = clock::now();
      opt->step();
      optim += ms_since(t);
    }
    // Trace spans of those steps (FSDP_TRACE=<dir>; empty otherwise), summed per kind:
    // forward/backward spans are a unit's compute including its waits and hooks;
    // all_gather spans run from issue to the end of the wait, reduce spans from issue to
    // completion (both overlap compute where prefetch issued them early).
    double span_ms[4] = {0, 0, 0, 0};  // forward, backward, all_gather, reduce
    const char* kinds[4] = {"forward ", "backward ", "all_gather ", "reduce "};
    for (const auto& sp : model->trace_spans())
      for (int i = 0; i < 4; ++i)
        if (sp.name.rfind(kinds[i], 0) == 0) span_ms[i] += (sp.end_us - sp.begin_us) * 1e-3;
    auto plain_model = make_model(a.model);
    for (int i = 0; i < a.warmup + 1; ++i)
      torch::nn::functional::cross_entropy(plain_model->forward(x), y).backward();
    fsdp::comm::barrier(pg);
    for (int i = 0; i < a.steps; ++i) {
      auto t = clock::now();
      for (auto& p : plain_model->parameters()) p.mutable_grad().zero_();
      plain_zero += ms_since(t);
      t = clock::now();
      auto loss = torch::nn::functional::cross_entropy(plain_model->forward(x), y);
      plain_fwd += ms_since(t);
      t = clock::now();
      loss.backward();
      plain_bwd += ms_since(t);
    }
    fsdp::comm::barrier(pg);
    const double k = 1.0 / a.steps;
    if (pg.rank() == 0)
      std::printf("{\"breakdown\": \"%s %s\", \"zero_grad_ms\": %.3f, \"forward_ms\": %.3f, \"backward_ms\": %.3f, "
                  "\"optimizer_step_ms\": %.3f, \"plain_zero_ms\": %.3f, \"plain_forward_ms\": %.3f, "
                  "\"plain_backward_ms\": %.3f, \"trace_forward_ms\": %.3f, \"trace_backward_ms\": %.3f, "
                  "\"trace_all_gather_ms\": %.3f, \"trace_reduce_ms\": %.3f}\n",
                  a.model.c_str(), a.strategy.c_str(), zero * k, fwd * k, bwd * k, optim * k, plain_zero * k,
                  plain_fwd * k, plain_bwd * k, span_ms[0] * k, span_ms[1] * k, span_ms[2] * k, span_ms[3] * k);
  }
  const char* shm_env = std::getenv("FSDP_SHARED_MEMORY");
  const bool shm = !(shm_env && std::string(shm_env) == "0");
  if (pg.rank() == 0) {
    std::string name = zero_stage ? (zero_stage == 1 ? "ZERO1" : "ZERO2") : fsdp::to_string(strategy);
    if (a.zero_overlap) name += "+overlap";
    if (a.optim == "cpuadam") name += "+CPUAdam";
    if (a.in_backward) name += "+in-backward";
    if (a.prefetch == "none") name += "+no-prefetch";
    if (a.prefetch == "fwd") name += "+fwd-prefetch";
    if (a.bucket_mb > 0) {
      char b[32];
      std::snprintf(b, sizeof b, "+bucket%g", a.bucket_mb);
      name += b;
    }
    if (strategy == fsdp::ShardingStrategy::kHybridShard) name += "(g=" + std::to_string(g) + ")";
    if (!shm) name += "+gloo-tcp";
    std::printf(
        "{\"model\": \"%s\", \"strategy\": \"%s\", \"world_size\": %d, \"step_ms\": %.3f, "
        "\"samples_per_s\": %.1f, \"bytes_communicated\": %lld, \"param_bytes\": %lld, \"grad_bytes\": %lld, "
        "\"optim_bytes\": %lld, \"peak_rss_bytes\": %lld, \"ring_optimum_bytes\": %lld, "
        "\"transport\": \"%s\", \"ceiling_ms\": %.3f, \"vs_ceiling\": %.3f, \"optimizer_ms\": %.3f, "
        "\"memcpy_gb_per_s\": %.2f, \"copy_ms\": %.3f, \"attainable_ms\": %.3f, \"vs_attainable\": %.3f, "
        "\"memcpy_uncached_gb_per_s\": %.2f, \"copy_uncached_ms\": %.3f, \"collectives_per_step\": %.1f}\n",
        a.model.c_str(), name.c_str(), n, step_s * 1e3, global_batch / step_s, (long long)bytes,
        (long long)mem.param_shard_bytes, (long long)mem.grad_shard_bytes, (long long)optim_bytes,
        (long long)ru.ru_maxrss * 1024, (long long)optimum, shm ? "shm" : "gloo-tcp", ceiling_ms,
        ceiling_ms / step_ms, optimizer_ms, memcpy_bps * 1e-9, copy_ms, attainable_ms, attainable_ms / step_ms,
        uncached_bps * 1e-9, copy_uncached_ms, static_cast<double>(calls) / a.steps);
    std::fflush(stdout);
  }
  return 0;
}

// ---- launcher mode ----

// Shared with bench_collectives: bench/bench_launch.h.
std::string self_exe() { return fsdp::bench::self_exe("bench_strategies"); }

// Runs a command and returns the JSON lines it printed (rank 0's, prefix removed).
std::vector<std::string> json_lines(const std::string& cmd) {
  return fsdp::bench::json_lines(cmd, "bench_strategies");
}

// Minimal field access in our own flat JSON lines.
std::string field(const std::string& json, const std::string& key) {
  auto k = json.find("\"" + key + "\": ");
  if (k == std::string::npos) return "";
  auto v = k + key.size() + 4;
  auto e = json.find_first_of(",}", v);
  std::string s = json.substr(v, e - v);
  if (!s.empty() && s.front() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

int launcher_main(const Args& a) {
  if (a.zero_targets && a.peers) usage_error("--zero-targets and --peers choose different rows; give one");
  const std::string self = self_exe();
  const std::string dir = self.substr(0, self.rfind('/'));
  const std::string run = dir + "/fsdp-run";
  struct Config { int n; std::string strategy, optim, prefetch; int g; double bucket_mb = 0; bool tcp = false; bool overlap = false; };
  std::vector<Config> configs{{2, "no_shard", "adam", "default", 0},
                              {2, "no_shard", "adam", "default", 0, 25},
                              {2, "shard_grad_op", "adam", "default", 0},
                              {2, "full_shard", "adam", "default", 0},
                              {2, "full_shard", "adam", "fwd", 0},
                              {2, "full_shard", "adam", "none", 0},
                              {2, "full_shard", "adam", "default", 0, 4},
                              {4, "hybrid_shard", "adam", "default", 2},
                              {4, "hybrid_shard", "adam", "default", 2, 25}};
  // ZeRO without a wrapper (fsdp::optim::ZeroRedundancyOptimizer).
  configs.push_back({2, "zero1", "adam", "default", 0});
  configs.push_back({2, "zero2", "adam", "default", 0});
  if (a.cpu_adam) {
    configs.push_back({2, "no_shard", "cpuadam", "default", 0});
    configs.push_back({2, "full_shard", "cpuadam", "default", 0});
    configs.push_back({2, "zero2", "cpuadam", "default", 0});
  }
  // The cross-host path: Gloo over TCP (shared-memory transport off), in the same
  // run as Python DDP, whose Gloo also goes over TCP.
  configs.push_back({2, "no_shard", "adam", "default", 0, 0, true});
  configs.push_back({2, "full_shard", "adam", "default", 0, 0, true});
  // --zero-targets: only the rows the ZeRO speed targets compare (and Python's
  // ZeroRedundancyOptimizer), so that more alternating rounds fit in the same time.
  if (a.zero_targets)
    configs = {{2, "no_shard", "cpuadam", "default", 0},
               {2, "zero2", "cpuadam", "default", 0},
               {2, "zero1", "adam", "default", 0},
               {2, "zero2", "adam", "default", 0},
               {2, "zero2", "adam", "default", 0, 0, false, /*overlap=*/true},
               // The same on Python ZeRO's transport, Gloo over TCP.
               {2, "zero1", "adam", "default", 0, 0, true},
               {2, "zero2", "adam", "default", 0, 0, true},
               {2, "zero2", "adam", "default", 0, 0, true, /*overlap=*/true}};
  // --peers: only the rows compared with Python DDP and FSDP2, on both transports.
  if (a.peers)
    configs = {{2, "full_shard", "adam", "default", 0},
               {2, "no_shard", "adam", "default", 0, 0, true},
               {2, "full_shard", "adam", "default", 0, 0, true}};
  // Python times one window of --steps; the C++ rows get one too unless --rounds asks for more.
  const int rank_rounds = a.rounds_given ? a.rounds : 1;
  // Rounds of every configuration in turn; each keeps its fastest run (see --repeat).
  std::vector<std::string> results;  // in configuration order, the fastest run of each
  std::vector<std::vector<std::string>> rounds(a.repeat);  // every run, by round
  int this_round = 0;
  auto keep_fastest = [&](const std::vector<std::string>& lines) {
    for (const auto& l : lines) {
      rounds[this_round].push_back(l);
      auto same = std::find_if(results.begin(), results.end(), [&](const std::string& r) {
        return field(r, "model") == field(l, "model") && field(r, "strategy") == field(l, "strategy") &&
               field(r, "world_size") == field(l, "world_size");
      });
      if (same == results.end()) results.push_back(l);
      else if (std::stod(field(l, "step_ms")) < std::stod(field(*same, "step_ms"))) *same = l;
    }
  };
  // One round's runs, every model's configurations and then its Python peers; odd rounds run
  // them in the reverse order, so that no row always runs first or last in a round.
  std::vector<std::string> commands;
  for (const auto& m : a.models) {
    for (const auto& c : configs) {
      std::ostringstream cmd;
      cmd << (c.tcp ? "FSDP_SHARED_MEMORY=0 " : "") << run << " --nproc " << c.n << " -- " << self << " --model " << m
          << " --strategy " << c.strategy << " --optim " << c.optim << " --prefetch " << c.prefetch
          << " --shard-group " << c.g << " --bucket-mb " << c.bucket_mb << " --steps " << a.steps << " --warmup "
          << a.warmup << " --rounds " << rank_rounds << (c.overlap ? " --zero-overlap" : "");
      commands.push_back(cmd.str());
    }
    if (!a.python) continue;
    // Python DDP, DDP + torch.distributed.optim.ZeroRedundancyOptimizer (Adam), and FSDP2.
    const char* py = std::getenv("FSDP_PYTHON");
    for (const char* extra : {"", " --zero", " --fsdp2"}) {
      if (a.zero_targets && std::strcmp(extra, " --zero") != 0) continue;
      if (a.peers && std::strcmp(extra, " --zero") == 0) continue;
      std::ostringstream cmd;
      cmd << "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 " << fsdp::bench::shell_quote(py && *py ? py : FSDP_PYTHON_EXECUTABLE)
          << " " << FSDP_SOURCE_DIR << "/bench/ddp_baseline.py --model " << m << " --world 2 --steps " << a.steps
          << " --warmup " << a.warmup << extra;
      commands.push_back(cmd.str());
    }
  }
  for (int round = 0; round < a.repeat; ++round) {
    this_round = round;
    if (round % 2 == 0)
      for (const auto& cmd : commands) keep_fastest(json_lines(cmd));
    else
      for (auto it = commands.rbegin(); it != commands.rend(); ++it) keep_fastest(json_lines(*it));
  }
  // Ratios between two rows of the same round: the rows of one round ran one after the
  // other, so load that comes and goes hits both alike.
  auto sps_of = [&](const std::vector<std::string>& lines, const std::string& model, const std::string& strategy) {
    for (const auto& l : lines)
      if (field(l, "model") == model && field(l, "strategy") == strategy) return std::stod(field(l, "samples_per_s"));
    return 0.0;
  };
  auto per_round = [&](const std::string& model, const std::string& num, const std::string& den) {
    std::vector<double> out;
    for (const auto& lines : rounds) {
      const double x = sps_of(lines, model, num), y = sps_of(lines, model, den);
      if (x > 0 && y > 0) out.push_back(x / y);
    }
    return out;
  };
  // A row's own per-round value of `key` (vs_ceiling: the step against the ceiling measured in
  // the same processes).
  auto own_per_round = [&](const std::string& model, const std::string& strategy, const std::string& key) {
    std::vector<double> out;
    for (const auto& lines : rounds)
      for (const auto& l : lines)
        if (field(l, "model") == model && field(l, "strategy") == strategy && !field(l, key).empty())
          out.push_back(std::stod(field(l, key)));
    return out;
  };
  auto median_range = [](const std::vector<double>& v, const char* unit) {
    if (v.empty()) return std::string("-");
    char b[64];
    std::snprintf(b, sizeof b, "%.2f%s (%.2f-%.2f)", fsdp::bench::median(v), unit, *std::min_element(v.begin(), v.end()),
                  *std::max_element(v.begin(), v.end()));
    return std::string(b);
  };
  std::printf("| model | strategy | N | fastest step ms | samples/s | vs Python DDP, median (range) of rounds | "
              "ceiling ms | vs ceiling, median (range) of rounds | attainable ms | vs attainable | MB sent/step | vs ring optimum | param MB | "
              "grad MB | optim MB | peak RSS MB |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
              "---: | ---: |\n");
  for (const auto& r : results) {
    const std::vector<double> vs_ddp = per_round(field(r, "model"), field(r, "strategy"), "PYTHON_DDP");
    const std::string vs_ceiling = median_range(own_per_round(field(r, "model"), field(r, "strategy"), "vs_ceiling"), "");
    const double sps = std::stod(field(r, "samples_per_s"));
    const std::string opt = field(r, "ring_optimum_bytes");
    const double mb = 1.0 / (1 << 20);
    const std::string ratio = median_range(vs_ddp, "x");
    char ring[32] = "-";
    if (!opt.empty() && std::stod(opt) > 0)
      std::snprintf(ring, sizeof ring, "%.3f", std::stod(field(r, "bytes_communicated")) / std::stod(opt));
    // Python rows (DDP, ZeRO, FSDP2) carry no ceiling.
    auto or_dash = [&](const char* key) { const std::string v = field(r, key); return v.empty() ? std::string("-") : v; };
    std::printf("| %s | %s | %s | %.1f | %.0f | %s | %s | %s | %s | %s | %.2f | %s | %.2f | %.2f | %.2f | %.0f |\n",
                field(r, "model").c_str(), field(r, "strategy").c_str(), field(r, "world_size").c_str(),
                std::stod(field(r, "step_ms")), sps, ratio.c_str(), or_dash("ceiling_ms").c_str(), vs_ceiling.c_str(),
                or_dash("attainable_ms").c_str(), or_dash("vs_attainable").c_str(),
                std::stod(field(r, "bytes_communicated")) * mb, ring,
                std::stod(field(r, "param_bytes")) * mb, std::stod(field(r, "grad_bytes")) * mb,
                std::stod(field(r, "optim_bytes")) * mb, std::stod(field(r, "peak_rss_bytes")) * mb);
  }
  for (const auto& r : results) std::printf("%s\n", r.c_str());
  // The speed targets as ratios of samples/s between two rows of the same round, their
  // median and range (a goal of 0: a comparison without a goal). FULL_SHARD against
  // PyTorch's DDP and FSDP2 over Gloo/TCP, their own transport (FSDP_SHARED_MEMORY=0), and
  // with the shared-memory transport, which Python lacks.
  struct Target { const char* name; const char* num; const char* den; double goal; };
  const Target targets[] = {{"zero2+cpuadam_vs_no_shard+cpuadam", "ZERO2+CPUAdam", "NO_SHARD+CPUAdam", 0.95},
                            {"zero1_vs_python_zero", "ZERO1", "PYTHON_DDP+ZERO", 1.5},
                            {"zero2_vs_python_zero", "ZERO2", "PYTHON_DDP+ZERO", 1.5},
                            {"zero2+overlap_vs_python_zero", "ZERO2+overlap", "PYTHON_DDP+ZERO", 1.5},
                            {"zero1+gloo-tcp_vs_python_zero", "ZERO1+gloo-tcp", "PYTHON_DDP+ZERO", 1.5},
                            {"zero2+gloo-tcp_vs_python_zero", "ZERO2+gloo-tcp", "PYTHON_DDP+ZERO", 1.5},
                            {"zero2+overlap+gloo-tcp_vs_python_zero", "ZERO2+overlap+gloo-tcp", "PYTHON_DDP+ZERO", 1.5},
                            {"full_shard+gloo-tcp_vs_python_fsdp2", "FULL_SHARD+gloo-tcp", "PYTHON_FSDP2", 2.0},
                            {"full_shard_vs_python_fsdp2", "FULL_SHARD", "PYTHON_FSDP2", 3.0},
                            {"full_shard+gloo-tcp_vs_python_ddp", "FULL_SHARD+gloo-tcp", "PYTHON_DDP", 0},
                            {"no_shard+gloo-tcp_vs_python_ddp", "NO_SHARD+gloo-tcp", "PYTHON_DDP", 0},
                            {"full_shard_vs_python_ddp", "FULL_SHARD", "PYTHON_DDP", 0}};
  for (const auto& m : a.models) {
    for (const auto& t : targets) {
      const std::vector<double> ratios = per_round(m, t.num, t.den);
      if (ratios.empty()) continue;
      std::string list;
      int met = 0;
      for (double r : ratios) {
        char v[16];
        std::snprintf(v, sizeof v, "%.3f", r);
        list += (list.empty() ? "" : ", ") + std::string(v);
        met += t.goal > 0 && r >= t.goal;
      }
      std::printf("{\"target\": \"%s\", \"model\": \"%s\", \"goal\": %.2f, \"ratio_per_round\": [%s], "
                  "\"median_ratio\": %.3f, \"min_ratio\": %.3f, \"max_ratio\": %.3f, \"rounds_meeting_goal\": %d, "
                  "\"rounds\": %zu}\n",
                  t.name, m.c_str(), t.goal, list.c_str(), fsdp::bench::median(ratios),
                  *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()),
                  met, ratios.size());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::bench::launcher_or_rank_main("bench_strategies", parse_args(argc, argv), launcher_main, rank_main);
}
