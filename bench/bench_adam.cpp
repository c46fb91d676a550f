// bench_adam: fsdp::optim::CPUAdam against torch::optim::Adam, ATen's fused CPU Adam and a
// bandwidth probe.
//
//   build/bin/bench_adam            10M and 100M parameters, 1 and 2 threads
//   build/bin/bench_adam --quick    1M parameters, few repetitions (smoke run)
//
// One parameter tensor of N fp32 elements with an fp32 gradient. Each measurement
// is the median of several optimizer steps after warm-up steps (the first step
// allocates the state). Throughput is N / seconds per step, in Gparam/s. The probe
// (bench/kernels/adam_probe.cpp) is a plain fused loop moving the same 28 bytes per
// parameter. ATen's fused Adam (`at::_fused_adam_`) is the kernel Python's
// `torch.optim.Adam(fused=True)` runs on CPU, called as that optimizer calls it (the step
// count a float tensor, incremented before the call). CPUAdam, the probe, torch::optim::Adam
// and the fused kernel each step a copy of the same parameter with the same gradient, with
// the same warm-up steps and the same number of timed steps, in alternation, so that noise
// from other processes hits all four alike. Prints a table, then one JSON object per line.
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "optim/kernels/adam_kernel.h"
#include "fsdp/optim/cpu_adam.h"

namespace fsdp_bench {
// Defined in bench/kernels/adam_probe.cpp (compiled with -march=native, no torch).
void adam_probe(float* __restrict param, const float* __restrict grad,
                float* __restrict exp_avg, float* __restrict exp_avg_sq, int64_t begin,
                int64_t end, float beta1, float beta2, float eps, float step_size,
                float bias_correction2_sqrt);
}  // namespace fsdp_bench

namespace {

double seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Row {
  int64_t params;
  int threads;
  double cpu_adam, torch_adam, fused_adam, probe;  // Gparam/s
};

Row measure(int64_t n, int threads, int warmup, int reps) {
  at::set_num_threads(threads);
  torch::manual_seed(0);
  auto param = torch::randn({n}).requires_grad_(true);
  param.mutable_grad() = torch::randn({n});
  Row row{n, threads, 0, 0, 0, 0};

  // Each contender updates its own copy of the parameter (same values, same gradient), so
  // that none sees another's updates.
  auto torch_param = param.detach().clone().requires_grad_(true);
  torch_param.mutable_grad() = param.grad();
  auto probe_param = param.detach().clone();
  auto probe_m = torch::zeros({n});
  auto probe_v = torch::zeros({n});
  int64_t probe_step = 0;
  auto probe_step_fn = [&] {
    ++probe_step;
    const double bc1 = 1 - std::pow(0.9, probe_step);
    const double bc2 = 1 - std::pow(0.999, probe_step);
    float* p = probe_param.data_ptr<float>();
    const float* g = param.grad().data_ptr<float>();
    float* m = probe_m.data_ptr<float>();
    float* v = probe_v.data_ptr<float>();
    // Same chunking as CPUAdam: 64-element aligned chunks, 32K-element grain.
    const int64_t chunks = (n + 63) / 64;
    at::parallel_for(0, chunks, 512, [&](int64_t c0, int64_t c1) {
      fsdp_bench::adam_probe(p, g, m, v, c0 * 64, std::min(n, c1 * 64), 0.9f, 0.999f, 1e-8f,
                             static_cast<float>(1e-3 / bc1),
                             static_cast<float>(std::sqrt(bc2)));
    });
  };

  auto fused_param = param.detach().clone();
  auto fused_m = torch::zeros({n});
  auto fused_v = torch::zeros({n});
  auto fused_steps = torch::zeros({}, torch::kFloat);
  auto fused_step_fn = [&] {
    fused_steps.add_(1);
    at::_fused_adam_({fused_param}, {param.grad()}, {fused_m}, {fused_v}, /*max_exp_avg_sqs=*/{}, {fused_steps},
                     /*lr=*/1e-3, /*beta1=*/0.9, /*beta2=*/0.999, /*weight_decay=*/0.0, /*eps=*/1e-8,
                     /*amsgrad=*/false, /*maximize=*/false);
  };

  fsdp::optim::CPUAdam ours({param}, fsdp::optim::CPUAdamOptions(1e-3));
  torch::optim::Adam theirs({torch_param}, torch::optim::AdamOptions(1e-3));
  for (int i = 0; i < warmup; ++i) {  // the first step allocates each optimizer's state
    ours.step();
    probe_step_fn();
    theirs.step();
    fused_step_fn();
  }
  std::vector<double> ours_s, probe_s, theirs_s, fused_s;
  for (int i = 0; i < reps; ++i) {
    ours_s.push_back(seconds([&] { ours.step(); }));
    probe_s.push_back(seconds(probe_step_fn));
    theirs_s.push_back(seconds([&] { theirs.step(); }));
    fused_s.push_back(seconds(fused_step_fn));
  }
  row.cpu_adam = n / median(ours_s) / 1e9;
  row.probe = n / median(probe_s) / 1e9;
  row.torch_adam = n / median(theirs_s) / 1e9;
  row.fused_adam = n / median(fused_s) / 1e9;
  // Every contender ran the same steps on the same gradient: a contender that skipped work
  // would show here rather than as speed.
  for (const auto& other : {torch_param.detach(), fused_param, probe_param})
    TORCH_CHECK(torch::allclose(other, param.detach(), /*rtol=*/1e-4, /*atol=*/1e-6),
                "bench_adam: the contenders' parameters differ after the same steps");
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("usage: bench_adam [--quick]\n  --quick  one 1M-element size, one warm-up (a smoke run)\n");
      return 0;
    } else {
      std::fprintf(stderr, "bench_adam: unknown argument '%s'\nusage: bench_adam [--quick]\n", argv[i]);
      return 2;
    }
  }
  const std::vector<int64_t> sizes =
      quick ? std::vector<int64_t>{1000000} : std::vector<int64_t>{10000000, 100000000};
  const int warmup = quick ? 1 : 3;
  const int reps = quick ? 3 : 9;
  const int saved_threads = at::get_num_threads();

  std::printf("CPUAdam kernel target: %s; libtorch intra-op threads by default: %d\n",
              fsdp::optim::kernels::adam_kernel_target().c_str(), saved_threads);
  std::vector<Row> rows;
  for (int64_t n : sizes) {
    for (int threads : {1, 2}) {
      rows.push_back(measure(n, threads, warmup, reps));
      const Row& r = rows.back();
      std::fprintf(stderr, "  measured %lld params, %d thread(s)\n",
                   static_cast<long long>(r.params), r.threads);
    }
  }
  at::set_num_threads(saved_threads);

  std::printf("\n| params | threads | CPUAdam Gparam/s | torch Adam Gparam/s | ATen fused Adam Gparam/s "
              "| probe Gparam/s | CPUAdam / torch | CPUAdam / fused | CPUAdam / probe |\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Row& r : rows) {
    std::printf("| %lld | %d | %.3f | %.3f | %.3f | %.3f | %.1fx | %.2fx | %.0f%% |\n",
                static_cast<long long>(r.params), r.threads, r.cpu_adam, r.torch_adam, r.fused_adam, r.probe,
                r.cpu_adam / r.torch_adam, r.cpu_adam / r.fused_adam, 100 * r.cpu_adam / r.probe);
  }
  std::printf("\n");
  for (const Row& r : rows) {
    std::printf("{\"params\": %lld, \"threads\": %d, \"cpu_adam_gparam_s\": %.4f, "
                "\"torch_adam_gparam_s\": %.4f, \"fused_adam_gparam_s\": %.4f, \"probe_gparam_s\": %.4f, "
                "\"cpu_adam_over_torch\": %.2f, \"cpu_adam_over_fused\": %.3f, \"cpu_adam_over_probe\": %.3f}\n",
                static_cast<long long>(r.params), r.threads, r.cpu_adam, r.torch_adam, r.fused_adam, r.probe,
                r.cpu_adam / r.torch_adam, r.cpu_adam / r.fused_adam, r.cpu_adam / r.probe);
  }
  return 0;
}
