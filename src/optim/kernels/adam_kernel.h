// Fused Adam/AdamW update over raw buffers, vectorised with Google Highway.
//
// Torch-free on purpose: this header is included by the Highway translation unit,
// which is compiled once per SIMD target without the precompiled torch header.
// src/optim/cpu_adam.cpp owns everything torch-facing (state, checks, threads) and
// calls adam_step() on chunks of one parameter tensor from at::parallel_for.
//
// Words used below: a "parameter" is one fp32 master tensor seen as a flat array of
// `numel` floats; its "state" is the three (four with amsgrad) fp32 arrays of the
// same length that torch::optim::AdamParamState holds; the "copy-out" is an
// optional low-precision (bf16/fp16) array that receives the updated parameter.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace optim {
namespace kernels {

/// Element type of the gradient array. The master parameter is always fp32;
/// a bf16/fp16 gradient is widened exactly to fp32 in registers.
enum class AdamGradType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

/// Element type of the copy-out array (kNone: no copy-out).
enum class AdamOutType : int { kNone = 0, kBFloat16 = 1, kFloat16 = 2 };

/// Scalars of one step, already rounded to fp32 the way libtorch's tensor ops
/// round them (a double Scalar becomes a float when it meets a float tensor).
/// Build it with adam_hyper_params() so the rounding is the same everywhere.
struct AdamHyperParams {
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  bool l2_decay = false;          // Adam: grad += weight_decay * param
  float weight_decay = 0.f;
  bool decoupled_decay = false;   // AdamW: param *= 1 - lr * weight_decay
  float decay_factor = 1.f;
  float bias_correction2_sqrt = 1.f;  // sqrt(1 - beta2^step), computed in double
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;   // -(lr / (1 - beta1^step)), computed in double
  bool amsgrad = false;
  bool maximize = false;
};

/// Computes the per-step scalars in double on the host, then rounds them to
/// fp32, in the same order as torch::optim::Adam::step / AdamW::step (1.13).
/// `step` is the state's step count after incrementing (1 on the first step).
AdamHyperParams adam_hyper_params(double lr, double beta1, double beta2, double eps,
                                  double weight_decay, int64_t step, bool adamw_mode,
                                  bool amsgrad, bool maximize);

/// The arrays of one parameter; all have the parameter's numel elements.
struct AdamBuffers {
  float* param = nullptr;
  const void* grad = nullptr;
  AdamGradType grad_type = AdamGradType::kFloat32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // required iff hyper.amsgrad
  void* out = nullptr;              // required iff out_type != kNone
  AdamOutType out_type = AdamOutType::kNone;
};

/// Updates elements [begin, end) in one pass: each array is read once and written
/// once. Per element, in libtorch's order of fp32 operations:
///   g = maximize ? -grad : grad;  g = fma(param, wd, g)            (Adam, wd != 0)
///   param = param * (1 - lr*wd)                                   (AdamW, wd != 0)
///   m = fma(g, 1-b1, m*b1);  v = fma((1-b2)*g, g, v*b2);  vmax = max(vmax, v)
///   param = param + (-step_size * m) / (sqrt(amsgrad ? vmax : v) / sqrt(bc2) + eps)
///   out = round_to_nearest_even(param)                            (copy-out)
/// Thread-safe for disjoint ranges. Chunks should start at multiples of 64
/// elements so that every chunk's vectors keep the same alignment.
void adam_step(const AdamHyperParams& hyper, const AdamBuffers& buffers, int64_t begin,
               int64_t end);

/// Name of the SIMD target adam_step() dispatches to on this CPU (e.g. "AVX3").
std::string adam_kernel_target();

/// Highway target bits of every target compiled in and supported here, best first.
std::vector<int64_t> adam_kernel_supported_targets();

/// Testing hook: restricts dispatch to one target from
/// adam_kernel_supported_targets(); 0 restores the normal choice. Process-wide
/// (Highway's dispatch state is global), so call it only from single-threaded tests.
void adam_kernel_force_target(int64_t target);

}  // namespace kernels
}  // namespace optim
}  // namespace fsdp
