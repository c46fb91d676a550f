// What the memory tracer (include/fsdp/core/memory_tracer.h) costs per training step:
// the target is < 2%, cheap enough to leave on (docs/benchmarks.md).
//
// Each run is one process group of --nproc ranks training the same FULL_SHARD model (a
// stack of --layers pre-norm MLP blocks of width --dim, one unit each, Adam) for --steps
// timed steps after --warmup untimed ones, in one of two modes:
//   off  no tracer, the CPU allocator as libtorch installs it;
//   on   fsdp::memory::enable_allocator_counting() before any tensor (the "other" category)
//        and a MemoryTracer over the model and the optimizer (4 samples per unit per step
//        plus one per optimizer step), as fsdp-train --memory-trace runs.
// The launcher runs --pairs pairs of runs, alternating which mode goes first, and reports
// each pair's ratio on/off of the median step time and the median of those ratios: drift of
// a shared machine's load hits both halves of a pair alike. Because that ratio drowns in the
// noise of a loaded machine, the two costs are also timed alone: one sample's bookkeeping
// (x samples per step) and one small allocation with and without the counting allocator
// (x allocations per step, counted). Rank 0 prints one JSON line per run; the launcher
// prints the table, both shares of a step and a final JSON summary line.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "bench_launch.h"
#include "common/tool_error.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/memory_tracer.h"

namespace {

struct Args {
  int nproc = 2, pairs = 5, steps = 20, warmup = 3, layers = 8, dim = 256, batch = 4, seq = 32, threads = 1;
  std::string mode;  // set on the ranks' command line only: off | on
};

const char* kUsage =
    "usage: bench_memory_tracer [--nproc 2] [--pairs 5] [--steps 20] [--warmup 3] [--layers 8] [--dim 256]\n"
    "                           [--batch 4] [--seq 32] [--threads 1]\n"
    "(what it measures: the comment at the top of bench/bench_memory_tracer.cpp)\n";

[[noreturn]] void usage_error(const std::string& what) {
  fsdp::tools::print_error("bench_memory_tracer", what + "\n" + kUsage);
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error("unknown argument or missing value: '" + flag + "'");
    const std::string v = argv[++i];
    if (flag == "--mode") {
      if (v != "off" && v != "on") usage_error("--mode is off or on, got '" + v + "'");
      a.mode = v;
      continue;
    }
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || n < (flag == "--warmup" ? 0 : 1))
      usage_error(flag + " expects an integer >= " + (flag == "--warmup" ? "0" : "1") + ", got '" + v + "'");
    int* field = flag == "--nproc"     ? &a.nproc
                 : flag == "--pairs"   ? &a.pairs
                 : flag == "--steps"   ? &a.steps
                 : flag == "--warmup"  ? &a.warmup
                 : flag == "--layers"  ? &a.layers
                 : flag == "--dim"     ? &a.dim
                 : flag == "--batch"   ? &a.batch
                 : flag == "--seq"     ? &a.seq
                 : flag == "--threads" ? &a.threads
                                       : nullptr;
    if (field == nullptr) usage_error("unknown argument '" + flag + "'");
    *field = static_cast<int>(n);
  }
  return a;
}

std::string rank_args(const Args& a, const std::string& mode) {
  std::ostringstream os;
  os << "--mode " << mode << " --steps " << a.steps << " --warmup " << a.warmup << " --layers " << a.layers
     << " --dim " << a.dim << " --batch " << a.batch << " --seq " << a.seq << " --threads " << a.threads;
  return os.str();
}

// ---- ranks --------------------------------------------------------------------------------

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2->forward(torch::gelu(fc1->forward(ln->forward(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int layers) {
    in = register_module("in", torch::nn::Linear(d, d));
    for (int i = 0; i < layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), fsdp::Wrappable<BlockImpl>(d)));
    head = register_module("head", torch::nn::Linear(d, d));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in->forward(x);
    for (auto& b : blocks) x = b->forward(x);
    return head->forward(x);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  std::vector<fsdp::Wrappable<BlockImpl>> blocks;
};

int rank_main(const Args& a) {
  const bool on = a.mode == "on";
  TORCH_CHECK(!a.mode.empty(), "bench_memory_tracer: the ranks need --mode (the launcher sets it)");
  if (on) fsdp::memory::enable_allocator_counting();  // before any tensor, as fsdp-train does
  at::set_num_threads(a.threads);
  auto pg = fsdp::comm::init_process_group();
  torch::manual_seed(0);
  auto net = std::make_shared<NetImpl>(a.dim, a.layers);
  auto model = fsdp::FullyShardedDataParallel(
      net, pg, fsdp::Options().auto_wrap_policy(fsdp::module_type_policy<BlockImpl>()));
  torch::optim::Adam opt(model->parameters(), 1e-4);
  std::unique_ptr<fsdp::MemoryTracer> tracer;
  if (on) tracer = std::make_unique<fsdp::MemoryTracer>(*model, &opt);
  auto gen = at::detail::createCPUGenerator(100 + pg.rank());
  const auto x = at::randn({a.batch, a.seq, a.dim}, gen);
  const auto y = at::randn({a.batch, a.seq, a.dim}, gen);
  std::vector<double> ms;
  int64_t allocations_before = 0;
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    if (s == a.warmup) {
      fsdp::comm::barrier(pg);
      allocations_before = fsdp::memory::counted_allocations();
    }
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad(/*set_to_none=*/false);
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
    if (tracer) tracer->step();
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s >= a.warmup) ms.push_back(dt);
  }
  // The slowest rank's step times (every rank waits for it in the collectives anyway).
  auto t = torch::tensor(ms, torch::kFloat64);
  fsdp::comm::all_reduce(pg, t, fsdp::comm::ReduceOp::kMax).wait();
  std::vector<double> slowest(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  std::sort(slowest.begin(), slowest.end());
  // What one sample's bookkeeping costs, without the noise of the steps around it:
  // get_memory_usage() walks the units like a sample does, and recounts the optimizer
  // state, which a sample takes from the last step (so this is an upper bound).
  double sample_us = 0;
  if (tracer) {
    const int reps = 2000;
    int64_t sink = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) sink += tracer->get_memory_usage().total();
    sample_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
    TORCH_CHECK(sink > 0);
  }
  const double allocations_per_step =
      double(fsdp::memory::counted_allocations() - allocations_before) / a.steps;
  // One CPU allocation and free of a small tensor, timed alone: the counting allocator's
  // cost is the difference between an "on" and an "off" run.
  double alloc_ns = 0;
  {
    const int reps = 200000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) (void)at::empty({64});
    alloc_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reps;
  }
  const int64_t samples = tracer ? int64_t(tracer->samples().size()) : 0;
  if (pg.rank() == 0)
    std::printf("{\"mode\": \"%s\", \"steps\": %d, \"median_ms\": %.4f, \"min_ms\": %.4f, \"samples\": %lld, "
                "\"samples_per_step\": %.1f, \"sample_us\": %.3f, \"allocations_per_step\": %.1f, "
                "\"alloc_ns\": %.1f}\n",
                a.mode.c_str(), a.steps, slowest[slowest.size() / 2], slowest.front(), (long long)samples,
                double(samples) / (a.warmup + a.steps), sample_us, allocations_per_step, alloc_ns);
  return 0;
}

// ---- launcher -----------------------------------------------------------------------------

double field(const std::string& json, const std::string& key) {
  const auto at = json.find("\"" + key + "\": ");
  TORCH_CHECK(at != std::string::npos, "bench_memory_tracer: no '", key, "' in ", json);
  return std::stod(json.substr(at + key.size() + 4));
}

int launcher_main(const Args& a) {
  const std::string self = fsdp::bench::self_exe("bench_memory_tracer");
  const std::string launcher = fsdp::bench::launcher_next_to(self);
  if (::access(launcher.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "bench_memory_tracer: %s not found; build it (cmake --build <build> --target fsdp-run)\n",
                 launcher.c_str());
    return 1;
  }
  auto run = [&](const std::string& mode) {
    const std::string cmd = fsdp::bench::shell_quote(launcher) + " --nproc " + std::to_string(a.nproc) + " -- " +
                            fsdp::bench::shell_quote(self) + " " + rank_args(a, mode);
    const auto lines = fsdp::bench::json_lines(cmd, "bench_memory_tracer");
    TORCH_CHECK(lines.size() == 1, "bench_memory_tracer: the '", mode, "' run printed ", lines.size(),
                " result lines, expected 1");
    std::printf("%s\n", lines[0].c_str());
    std::fflush(stdout);
    return lines[0];
  };
  std::printf("memory tracer overhead: %d ranks, %d blocks of width %d, batch %d x %d, %d timed steps per run, "
              "%d alternating pairs\n",
              a.nproc, a.layers, a.dim, a.batch, a.seq, a.steps, a.pairs);
  std::vector<double> ratios;
  std::vector<std::string> rows;
  double last_samples_per_step = 0, last_sample_us = 0, last_on_ms = 1, last_allocations_per_step = 0;
  std::vector<double> alloc_extra_ns;  // per pair: on - off, one allocation and free
  for (int p = 0; p < a.pairs; ++p) {
    const bool off_first = p % 2 == 0;
    std::string off, on;
    if (off_first) {
      off = run("off");
      on = run("on");
    } else {
      on = run("on");
      off = run("off");
    }
    const double r = field(on, "median_ms") / field(off, "median_ms");
    alloc_extra_ns.push_back(field(on, "alloc_ns") - field(off, "alloc_ns"));
    last_allocations_per_step = field(on, "allocations_per_step");
    last_samples_per_step = field(on, "samples_per_step");
    last_sample_us = field(on, "sample_us");
    last_on_ms = field(on, "median_ms");
    ratios.push_back(r);
    char row[160];
    std::snprintf(row, sizeof row, "| %d | %s | %.2f | %.2f | %.4f |", p + 1, off_first ? "off, on" : "on, off",
                  field(off, "median_ms"), field(on, "median_ms"), r);
    rows.push_back(row);
  }
  std::printf("\n| pair | order | off: median step ms | on: median step ms | on / off |\n| --- | --- | --- | --- | --- |\n");
  for (const auto& r : rows) std::printf("%s\n", r.c_str());
  std::vector<double> sorted = ratios;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  // The sampling's own share of a step: samples per step x cost of one, over the median
  // step (of the last "on" run); the allocator counting's share is only in the ratio.
  std::printf("\nsampling alone: %.1f samples/step x %.2f us = %.3f ms per step, %.3f%% of a %.1f ms step\n",
              last_samples_per_step, last_sample_us, last_samples_per_step * last_sample_us / 1000,
              100 * last_samples_per_step * last_sample_us / 1000 / last_on_ms, last_on_ms);
  std::sort(alloc_extra_ns.begin(), alloc_extra_ns.end());
  const double extra_ns = alloc_extra_ns[alloc_extra_ns.size() / 2];
  const double counting_share = last_allocations_per_step * std::max(0.0, extra_ns) / 1e6 / last_on_ms;
  std::printf("allocator counting: %.0f allocations/step x %.1f ns extra each (median over pairs) = %.3f ms per "
              "step, %.3f%% of a %.1f ms step\n",
              last_allocations_per_step, extra_ns, last_allocations_per_step * extra_ns / 1e6, 100 * counting_share,
              last_on_ms);
  const double sampling_share = last_samples_per_step * last_sample_us / 1000 / last_on_ms;
  std::printf("\n{\"bench\": \"memory_tracer\", \"pairs\": %d, \"median_ratio\": %.4f, \"min_ratio\": %.4f, "
              "\"max_ratio\": %.4f, \"target\": 1.02, \"sampling_share\": %.5f, \"counting_share\": %.5f}\n",
              a.pairs, median, sorted.front(), sorted.back(), sampling_share, counting_share);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::bench::launcher_or_rank_main("bench_memory_tracer", parse_args(argc, argv), launcher_main, rank_main);
}
