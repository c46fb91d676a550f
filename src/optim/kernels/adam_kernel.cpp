// Fused Adam/AdamW kernel (see adam_kernel.h for the contract).
//
// Highway compiles this file once per SIMD target (foreach_target.h re-includes it)
// and adam_step() picks the best one for this CPU at run time.
//
// Why the arithmetic looks the way it does: torch::optim::Adam runs one ATen
// kernel per operation, each rounding to fp32. To match it to the last bit, every
// line of the per-vector body reproduces one of those kernels as compiled in
// Debian's libtorch: add/add_ with alpha is a fused multiply-add, addcmul is
// fma(value * t1, t2, self) (GCC fuses it), addcdiv is self + (value * t1) / t2,
// and the bias corrections are double scalars rounded to fp32 once. Targets
// without FMA (SSE4 and older) round twice where libtorch fuses: a few ulp apart.
//
// Tail handling: the last partial vector of a range is copied into small padded
// stack buffers, run through the same vector body, and copied back, so every
// element goes through identical instructions whatever the chunking (results do
// not depend on the number of threads) and nothing reads past the arrays.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/optim/kernels/adam_kernel.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "adam_kernel.h"

// Scalar fp16 <-> fp32 conversions with round-to-nearest-even, bit-identical to
// c10::Half (which uses the same algorithm, from the FP16 library). Used on
// targets without hardware conversions, where Highway 1.0's emulated DemoteTo
// truncates instead of rounding.
#ifndef FSDP_ADAM_KERNEL_SCALAR_HELPERS
#define FSDP_ADAM_KERNEL_SCALAR_HELPERS
namespace fsdp {
namespace optim {
namespace kernels {
namespace detail {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized = float_of((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = UINT32_C(126) << 23;
  const float denormalized = float_of((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
  return float_of(sign | (two_w < denormalized_cutoff ? bits_of(denormalized)
                                                      : bits_of(normalized)));
}

inline uint16_t float_to_half(float f) {
  const float scale_to_inf = float_of(UINT32_C(0x77800000));
  const float scale_to_zero = float_of(UINT32_C(0x08800000));
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = bits_of(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = float_of((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = bits_of(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) |
                               (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
}

}  // namespace detail
}  // namespace kernels
}  // namespace optim
}  // namespace fsdp
#endif  // FSDP_ADAM_KERNEL_SCALAR_HELPERS

HWY_BEFORE_NAMESPACE();
namespace fsdp {
namespace optim {
namespace kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Hardware fp16 conversion (F16C / AVX-512) rounds to nearest even like c10::Half.
#if HWY_ARCH_X86 && HWY_TARGET < HWY_SSE4 && !defined(HWY_DISABLE_F16C)
#define FSDP_ADAM_HW_F16 1
#else
#define FSDP_ADAM_HW_F16 0
#endif

using DF = hn::ScalableTag<float>;
using DU32 = hn::RebindToUnsigned<DF>;
using DI32 = hn::RebindToSigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;
using VF = hn::Vec<DF>;

// Upper bound of lanes per vector, for stack buffers.
constexpr size_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);

// bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits.
HWY_INLINE VF LoadBF16(const uint16_t* p) {
  const DF df;
  const DU32 du32;
  const auto wide = hn::PromoteTo(du32, hn::LoadU(DU16(), p));
  return hn::BitCast(df, hn::ShiftLeft<16>(wide));
}

HWY_INLINE VF LoadF16(const uint16_t* p) {
  const DF df;
#if FSDP_ADAM_HW_F16
  const hn::Rebind<hwy::float16_t, DF> df16;
  return hn::PromoteTo(df, hn::LoadU(df16, reinterpret_cast<const hwy::float16_t*>(p)));
#else
  HWY_ALIGN float tmp[kMaxLanes];
  for (size_t i = 0; i < hn::Lanes(df); ++i) tmp[i] = detail::half_to_float(p[i]);
  return hn::Load(df, tmp);
#endif
}

// fp32 -> bf16 with round-to-nearest-even and NaN -> 0x7FC0, exactly like
// c10::BFloat16(float). Highway 1.0's DemoteTo(bf16) truncates, hence by hand.
HWY_INLINE void StoreBF16(VF v, uint16_t* p) {
  const DU32 du32;
  const DI32 di32;
  const auto bits = hn::BitCast(du32, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(lsb, hn::Set(du32, 0x7FFF))));
  const auto is_nan = hn::RebindMask(du32, hn::Ne(v, v));
  const auto result = hn::IfThenElse(is_nan, hn::Set(du32, 0x7FC0), rounded);
  // Every lane is <= 0xFFFF, so the saturating i32 -> u16 demotion is exact.
  hn::StoreU(hn::DemoteTo(DU16(), hn::BitCast(di32, result)), DU16(), p);
}

HWY_INLINE void StoreF16(VF v, uint16_t* p) {
  const DF df;
#if FSDP_ADAM_HW_F16
  const hn::Rebind<hwy::float16_t, DF> df16;
  hn::StoreU(hn::DemoteTo(df16, v), df16, reinterpret_cast<hwy::float16_t*>(p));
#else
  HWY_ALIGN float tmp[kMaxLanes];
  hn::Store(v, df, tmp);
  for (size_t i = 0; i < hn::Lanes(df); ++i) p[i] = detail::float_to_half(tmp[i]);
#endif
}

template <AdamGradType G>
HWY_INLINE VF LoadGrad(const void* grad, size_t offset) {
  if (G == AdamGradType::kFloat32) {
    return hn::LoadU(DF(), static_cast<const float*>(grad) + offset);
  } else if (G == AdamGradType::kBFloat16) {
    return LoadBF16(static_cast<const uint16_t*>(grad) + offset);
  } else {
    return LoadF16(static_cast<const uint16_t*>(grad) + offset);
  }
}

template <AdamOutType O>
HWY_INLINE void StoreOut(VF v, void* out, size_t offset) {
  if (O == AdamOutType::kBFloat16) {
    StoreBF16(v, static_cast<uint16_t*>(out) + offset);
  } else if (O == AdamOutType::kFloat16) {
    StoreF16(v, static_cast<uint16_t*>(out) + offset);
  }
}

// libtorch rounds p * (1 - lr * wd) to fp32 before adding the update (two ATen
// kernels); without this barrier GCC (-ffp-contract=fast by default) may fuse the
// two into one fma and round once. Only FMA-capable x86 targets can fuse.
template <class V>
HWY_INLINE V Rounded(V v) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
  asm("" : "+v"(v.raw));
#endif
  return v;
}

// The per-vector update. Each statement mirrors one ATen kernel of
// torch::optim::Adam::step (see the file comment); keep that order.
template <AdamGradType G, AdamOutType O>
HWY_INLINE void UpdateVector(const AdamHyperParams& h, const AdamBuffers& b, size_t i) {
  const DF df;
  VF param = hn::LoadU(df, b.param + i);
  VF grad = LoadGrad<G>(b.grad, i);
  if (h.maximize) grad = hn::Neg(grad);
  // grad.add(p, wd): ATen's vector add with alpha is fmadd(p, alpha, grad).
  if (h.l2_decay) grad = hn::MulAdd(param, hn::Set(df, h.weight_decay), grad);
  // p.mul_(1 - lr * wd)
  if (h.decoupled_decay) param = Rounded(hn::Mul(param, hn::Set(df, h.decay_factor)));
  // exp_avg.mul_(beta1).add_(grad, 1 - beta1)
  VF exp_avg = hn::Mul(hn::LoadU(df, b.exp_avg + i), hn::Set(df, h.beta1));
  exp_avg = hn::MulAdd(grad, hn::Set(df, h.one_minus_beta1), exp_avg);
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
  VF exp_avg_sq = hn::Mul(hn::LoadU(df, b.exp_avg_sq + i), hn::Set(df, h.beta2));
  // ATen's addcmul is `self + value * t1 * t2` and GCC fuses it (measured on this
  // libtorch: fma(value * t1, t2, self) for every element), so fuse it the same way.
  exp_avg_sq = hn::MulAdd(hn::Mul(hn::Set(df, h.one_minus_beta2), grad), grad, exp_avg_sq);
  VF second = exp_avg_sq;
  if (h.amsgrad) {
    // torch::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq)
    second = hn::Max(exp_avg_sq, hn::LoadU(df, b.max_exp_avg_sq + i));
    hn::StoreU(second, df, b.max_exp_avg_sq + i);
  }
  // denom = (second.sqrt() / sqrt(bias_correction2)).add_(eps)
  const VF denom = hn::Add(hn::Div(hn::Sqrt(second), hn::Set(df, h.bias_correction2_sqrt)),
                           hn::Set(df, h.eps));
  // p.addcdiv_(exp_avg, denom, -step_size)
  param = hn::Add(param, hn::Div(hn::Mul(hn::Set(df, h.neg_step_size), exp_avg), denom));

  hn::StoreU(param, df, b.param + i);
  hn::StoreU(exp_avg, df, b.exp_avg + i);
  hn::StoreU(exp_avg_sq, df, b.exp_avg_sq + i);
  StoreOut<O>(param, b.out, i);
}

constexpr size_t GradBytes(AdamGradType g) { return g == AdamGradType::kFloat32 ? 4 : 2; }

template <AdamGradType G, AdamOutType O>
void AdamRange(const AdamHyperParams& h, const AdamBuffers& b, int64_t begin, int64_t end) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  size_t i = static_cast<size_t>(begin);
  const size_t stop = static_cast<size_t>(end);
  for (; i + lanes <= stop; i += lanes) UpdateVector<G, O>(h, b, i);
  if (i == stop) return;

  // Tail: run the same body on padded copies (see the file comment).
  const size_t n = stop - i;
  HWY_ALIGN float param[kMaxLanes] = {};
  HWY_ALIGN float exp_avg[kMaxLanes] = {};
  HWY_ALIGN float exp_avg_sq[kMaxLanes] = {};
  HWY_ALIGN float max_exp_avg_sq[kMaxLanes] = {};
  HWY_ALIGN float grad[kMaxLanes] = {};  // large enough for any grad type
  HWY_ALIGN uint16_t out[kMaxLanes] = {};
  constexpr size_t gbytes = GradBytes(G);
  std::memcpy(param, b.param + i, n * sizeof(float));
  std::memcpy(grad, static_cast<const char*>(b.grad) + i * gbytes, n * gbytes);
  std::memcpy(exp_avg, b.exp_avg + i, n * sizeof(float));
  std::memcpy(exp_avg_sq, b.exp_avg_sq + i, n * sizeof(float));
  if (h.amsgrad) std::memcpy(max_exp_avg_sq, b.max_exp_avg_sq + i, n * sizeof(float));

  AdamBuffers tail = b;
  tail.param = param;
  tail.grad = grad;
  tail.exp_avg = exp_avg;
  tail.exp_avg_sq = exp_avg_sq;
  tail.max_exp_avg_sq = max_exp_avg_sq;
  tail.out = out;
  UpdateVector<G, O>(h, tail, 0);

  std::memcpy(b.param + i, param, n * sizeof(float));
  std::memcpy(b.exp_avg + i, exp_avg, n * sizeof(float));
  std::memcpy(b.exp_avg_sq + i, exp_avg_sq, n * sizeof(float));
  if (h.amsgrad) std::memcpy(b.max_exp_avg_sq + i, max_exp_avg_sq, n * sizeof(float));
  if (O != AdamOutType::kNone) {
    std::memcpy(static_cast<uint16_t*>(b.out) + i, out, n * sizeof(uint16_t));
  }
}

template <AdamGradType G>
void AdamRangeForOut(const AdamHyperParams& h, const AdamBuffers& b, int64_t begin,
                     int64_t end) {
  switch (b.out_type) {
    case AdamOutType::kNone:
      return AdamRange<G, AdamOutType::kNone>(h, b, begin, end);
    case AdamOutType::kBFloat16:
      return AdamRange<G, AdamOutType::kBFloat16>(h, b, begin, end);
    case AdamOutType::kFloat16:
      return AdamRange<G, AdamOutType::kFloat16>(h, b, begin, end);
  }
}

void AdamStep(const AdamHyperParams& h, const AdamBuffers& b, int64_t begin, int64_t end) {
  switch (b.grad_type) {
    case AdamGradType::kFloat32:
      return AdamRangeForOut<AdamGradType::kFloat32>(h, b, begin, end);
    case AdamGradType::kBFloat16:
      return AdamRangeForOut<AdamGradType::kBFloat16>(h, b, begin, end);
    case AdamGradType::kFloat16:
      return AdamRangeForOut<AdamGradType::kFloat16>(h, b, begin, end);
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

#undef FSDP_ADAM_HW_F16

}  // namespace HWY_NAMESPACE
}  // namespace kernels
}  // namespace optim
}  // namespace fsdp
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fsdp {
namespace optim {
namespace kernels {

HWY_EXPORT(AdamStep);
HWY_EXPORT(TargetName);

AdamHyperParams adam_hyper_params(double lr, double beta1, double beta2, double eps,
                                  double weight_decay, int64_t step, bool adamw_mode,
                                  bool amsgrad, bool maximize) {
  // Same expressions as torch/csrc/api/src/optim/adam.cpp and adamw.cpp (1.13);
  // each double is rounded to fp32 where the tensor op would convert its Scalar.
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  AdamHyperParams h;
  h.beta1 = static_cast<float>(beta1);
  h.one_minus_beta1 = static_cast<float>(1 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1 - beta2);
  if (weight_decay != 0) {
    if (adamw_mode) {
      h.decoupled_decay = true;
      h.decay_factor = static_cast<float>(1 - lr * weight_decay);
    } else {
      h.l2_decay = true;
      h.weight_decay = static_cast<float>(weight_decay);
    }
  }
  h.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  h.eps = static_cast<float>(eps);
  h.neg_step_size = static_cast<float>(-step_size);
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  return h;
}

void adam_step(const AdamHyperParams& hyper, const AdamBuffers& buffers, int64_t begin,
               int64_t end) {
  if (begin >= end) return;
  HWY_DYNAMIC_DISPATCH(AdamStep)(hyper, buffers, begin, end);
}

std::string adam_kernel_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

std::vector<int64_t> adam_kernel_supported_targets() {
  return hwy::SupportedAndGeneratedTargets();
}

void adam_kernel_force_target(int64_t target) {
  hwy::SetSupportedTargetsForTest(target);
  // Re-read the (mocked) CPU targets now rather than on some later call.
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

}  // namespace kernels
}  // namespace optim
}  // namespace fsdp
#endif  // HWY_ONCE
