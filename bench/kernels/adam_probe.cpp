// Bandwidth probe for bench_adam: the plainest fused fp32 Adam loop, compiled for
// this machine (-O3 -march=native -fno-math-errno, no torch). It moves the same 28
// bytes per parameter as CPUAdam (reads param, grad, exp_avg, exp_avg_sq; writes
// param, exp_avg, exp_avg_sq) and does the same sqrt and division, so its speed is
// what this memory system allows; CPUAdam is measured against it.
#include <cmath>
#include <cstdint>

namespace fsdp_bench {

// Declared again in bench/bench_adam.cpp, which calls it from at::parallel_for.
void adam_probe(float* __restrict param, const float* __restrict grad,
                float* __restrict exp_avg, float* __restrict exp_avg_sq, int64_t begin,
                int64_t end, float beta1, float beta2, float eps, float step_size,
                float bias_correction2_sqrt) {
  const float one_minus_beta1 = 1.f - beta1;
  const float one_minus_beta2 = 1.f - beta2;
  for (int64_t i = begin; i < end; ++i) {
    const float g = grad[i];
    const float m = beta1 * exp_avg[i] + one_minus_beta1 * g;
    const float v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] -= step_size * m / (std::sqrt(v) / bias_correction2_sqrt + eps);
  }
}

}  // namespace fsdp_bench
