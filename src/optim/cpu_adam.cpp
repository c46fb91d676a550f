// CPUAdam: the torch-facing half (options, state, checks, threads). The arithmetic
// of the fused path lives in kernels/adam_kernel.cpp; the fallback below is the
// same math written as libtorch 1.13's Adam::step / AdamW::step write it.
#include "fsdp/optim/cpu_adam.h"

// Built without the project's PCH, with OpenMP, so that at::parallel_for really runs
// in parallel (see FSDP_OPENMP_SOURCES in CMakeLists.txt): keep includes narrow.
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/serialize.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "optim/kernels/adam_kernel.h"
#include "fsdp/optim/group_options.h"
#include "optimizer_archive.h"
#include "memory/param_state_key.h"

namespace fsdp {
namespace optim {

namespace {

using torch::optim::AdamParamState;
using torch::optim::AdamWParamState;

// Chunks handed to threads start at multiples of this many elements, so every
// chunk sees the same vector alignment as a single-threaded pass.
constexpr int64_t kChunkAlign = 64;
// Below this many elements a parameter is updated by the calling thread alone:
// waking a thread costs more than streaming 32K elements (~1 MB of traffic).
constexpr int64_t kGrainElements = 32768;

using memory::param_state_key;
using memory::ParamStateKey;

void check_options(const CPUAdamOptions& o, const std::string& where) {
  TORCH_CHECK(o.lr() >= 0, "CPUAdam: invalid learning rate: ", o.lr(), where,
              "; use lr >= 0");
  TORCH_CHECK(o.eps() >= 0, "CPUAdam: invalid epsilon value: ", o.eps(), where,
              "; use eps >= 0");
  const double beta1 = std::get<0>(o.betas());
  const double beta2 = std::get<1>(o.betas());
  TORCH_CHECK(0 <= beta1 && beta1 < 1.0, "CPUAdam: invalid beta parameter at index 0: ",
              beta1, where, "; use 0 <= beta1 < 1");
  TORCH_CHECK(0 <= beta2 && beta2 < 1.0, "CPUAdam: invalid beta parameter at index 1: ",
              beta2, where, "; use 0 <= beta2 < 1");
  TORCH_CHECK(o.weight_decay() >= 0, "CPUAdam: invalid weight_decay value: ",
              o.weight_decay(), where, "; use weight_decay >= 0");
}

std::string describe(size_t group, size_t index, const torch::Tensor& p) {
  std::ostringstream s;
  s << " (parameter " << index << " of param group " << group << ", sizes " << p.sizes()
    << ", dtype " << p.scalar_type() << ", device " << p.device() << ")";
  return s.str();
}

// Makes sure `state` holds the tensors this step needs. Missing ones start at
// zero, as in libtorch; max_exp_avg_sq appears lazily when amsgrad is switched on
// for state that was created without it.
void ensure_state_tensors(AdamParamState& state, const torch::Tensor& p, bool amsgrad) {
  if (!state.exp_avg().defined()) {
    state.exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  }
  if (!state.exp_avg_sq().defined()) {
    state.exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  }
  if (amsgrad && !state.max_exp_avg_sq().defined()) {
    state.max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  }
}

void check_fused_state_tensor(const torch::Tensor& t, const char* name,
                              const torch::Tensor& p, const std::string& where) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device() == p.device() &&
                  t.numel() == p.numel() && t.is_contiguous(),
              "CPUAdam: state tensor ", name, " has dtype ", t.scalar_type(), ", device ",
              t.device(), ", ", t.numel(), " elements, contiguous ", t.is_contiguous(),
              where, "; the fused kernel needs contiguous fp32 state of the parameter's ",
              "size and device (state loaded from another optimizer? use fused(false))");
}

}  // namespace

// ----------------------------------------------------------------------------
// CPUAdamOptions

CPUAdamOptions::CPUAdamOptions(double lr) : lr_(lr) {}

CPUAdamOptions::CPUAdamOptions(const torch::optim::AdamOptions& adam)
    : lr_(adam.lr()),
      betas_(adam.betas()),
      eps_(adam.eps()),
      weight_decay_(adam.weight_decay()),
      amsgrad_(adam.amsgrad()),
      adamw_mode_(false) {}

CPUAdamOptions::CPUAdamOptions(const torch::optim::AdamWOptions& adamw)
    : lr_(adamw.lr()),
      betas_(adamw.betas()),
      eps_(adamw.eps()),
      weight_decay_(adamw.weight_decay()),
      amsgrad_(adamw.amsgrad()),
      adamw_mode_(true) {}

bool operator==(const CPUAdamOptions& lhs, const CPUAdamOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.betas() == rhs.betas() && lhs.eps() == rhs.eps() &&
         lhs.weight_decay() == rhs.weight_decay() && lhs.amsgrad() == rhs.amsgrad() &&
         lhs.adamw_mode() == rhs.adamw_mode() && lhs.maximize() == rhs.maximize() &&
         lhs.fused() == rhs.fused();
}

void CPUAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  // The first five keys are AdamOptions' own, so torch::optim::Adam reads them.
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adamw_mode);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(fused);
}

void CPUAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  // Every key is optional: archives written by torch::optim::Adam/AdamW lack ours.
  auto read_double = [&](const char* key, double& value) {
    c10::IValue ivalue;
    if (archive.try_read(key, ivalue)) value = ivalue.toDouble();
  };
  auto read_bool = [&](const char* key, bool& value) {
    c10::IValue ivalue;
    if (archive.try_read(key, ivalue)) value = ivalue.toBool();
  };
  read_double("lr", lr_);
  c10::IValue betas;
  if (archive.try_read("betas", betas)) betas_ = betas.to<betas_t>();
  read_double("eps", eps_);
  read_double("weight_decay", weight_decay_);
  read_bool("amsgrad", amsgrad_);
  read_bool("adamw_mode", adamw_mode_);
  read_bool("maximize", maximize_);
  read_bool("fused", fused_);
}

double CPUAdamOptions::get_lr() const { return lr(); }

void CPUAdamOptions::set_lr(const double lr) { this->lr(lr); }

// ----------------------------------------------------------------------------
// CPUAdam

CPUAdam::CPUAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                 CPUAdamOptions defaults)
    : Optimizer(param_groups, std::make_unique<CPUAdamOptions>(defaults)) {
  keep_group_options(*this, param_groups);
  check_options(defaults, " (default options)");
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    check_options(static_cast<const CPUAdamOptions&>(param_groups_[g].options()),
                  " (param group " + std::to_string(g) + ")");
  }
}

CPUAdam::CPUAdam(std::vector<torch::Tensor> params, CPUAdamOptions defaults)
    : CPUAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor CPUAdam::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = {};
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& group = param_groups_[g];
    // Options may have changed since construction (set_lr, add_param_group), and
    // the check is a handful of comparisons per group.
    const auto& options = static_cast<const CPUAdamOptions&>(group.options());
    check_options(options, " (param group " + std::to_string(g) + ")");
    for (size_t i = 0; i < group.params().size(); ++i) {
      auto& p = group.params()[i];
      if (!p.grad().defined()) continue;
      const torch::Tensor& grad = p.grad();
      TORCH_CHECK(!grad.is_sparse(), "CPUAdam does not support sparse gradients",
                  describe(g, i, p), "; densify them first (grad.to_dense())");

      const ParamStateKey key = param_state_key(p);
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto fresh = std::make_unique<AdamParamState>();
        fresh->step(0);
        it = state_.emplace(key, std::move(fresh)).first;
      }
      auto* state = dynamic_cast<AdamParamState*>(it->second.get());
      TORCH_CHECK(state != nullptr, "CPUAdam: the state of", describe(g, i, p),
                  " is not a torch::optim::AdamParamState; move state between optimizers "
                  "with fsdp::optim::copy_adam_state or torch::save/torch::load");
      ensure_state_tensors(*state, p, options.amsgrad());
      state->step(state->step() + 1);

      auto out_it = copy_out_.find(p.unsafeGetTensorImpl());
      const torch::Tensor out = out_it == copy_out_.end() ? torch::Tensor() : out_it->second;
      const std::string where = describe(g, i, p);
      if (options.fused() && p.device().is_cpu()) {
        update_fused(p, grad, *state, options, out, where);
      } else {
        update_with_tensor_ops(p, grad, *state, options, out, where);
      }
    }
  }
  return loss;
}

void CPUAdam::update_fused(torch::Tensor& p, const torch::Tensor& grad,
                           AdamParamState& state, const CPUAdamOptions& options,
                           const torch::Tensor& out, const std::string& where) {
  namespace k = kernels;
  TORCH_CHECK(p.scalar_type() == torch::kFloat32,
              "CPUAdam: the fused kernel takes fp32 parameters, got ", p.scalar_type(), where,
              "; keep an fp32 master copy or construct CPUAdam with "
              "CPUAdamOptions().fused(false)");
  TORCH_CHECK(p.is_contiguous(), "CPUAdam: the fused kernel needs a contiguous parameter",
              where, " with strides ", p.strides(),
              "; make it contiguous or use CPUAdamOptions().fused(false)");
  k::AdamBuffers b;
  switch (grad.scalar_type()) {
    case torch::kFloat32:
      b.grad_type = k::AdamGradType::kFloat32;
      break;
    case torch::kBFloat16:
      b.grad_type = k::AdamGradType::kBFloat16;
      break;
    case torch::kFloat16:
      b.grad_type = k::AdamGradType::kFloat16;
      break;
    default:
      TORCH_CHECK(false, "CPUAdam: unsupported gradient dtype ", grad.scalar_type(), where,
                  "; the fused kernel takes fp32, bf16 or fp16 gradients");
  }
  TORCH_CHECK(grad.device() == p.device() && grad.numel() == p.numel() &&
                  grad.is_contiguous(),
              "CPUAdam: the fused kernel needs a contiguous gradient of the parameter's ",
              "size and device; got sizes ", grad.sizes(), ", strides ", grad.strides(),
              ", device ", grad.device(), where,
              "; make it contiguous or use CPUAdamOptions().fused(false)");
  check_fused_state_tensor(state.exp_avg(), "exp_avg", p, where);
  check_fused_state_tensor(state.exp_avg_sq(), "exp_avg_sq", p, where);
  if (options.amsgrad()) {
    check_fused_state_tensor(state.max_exp_avg_sq(), "max_exp_avg_sq", p, where);
  }
  if (out.defined()) {
    // set_copy_out checked dtype, size and device; contiguity could only change
    // if someone replaced the tensor's storage since, so check it every step.
    TORCH_CHECK(out.is_contiguous(), "CPUAdam: the copy-out tensor of", where,
                " is no longer contiguous");
    b.out_type = out.scalar_type() == torch::kBFloat16 ? k::AdamOutType::kBFloat16
                                                       : k::AdamOutType::kFloat16;
    b.out = out.data_ptr();
  }

  b.param = p.data_ptr<float>();
  b.grad = grad.data_ptr();
  b.exp_avg = state.exp_avg().data_ptr<float>();
  b.exp_avg_sq = state.exp_avg_sq().data_ptr<float>();
  if (options.amsgrad()) b.max_exp_avg_sq = state.max_exp_avg_sq().data_ptr<float>();

  const auto& betas = options.betas();
  const k::AdamHyperParams h = k::adam_hyper_params(
      options.lr(), std::get<0>(betas), std::get<1>(betas), options.eps(),
      options.weight_decay(), state.step(), options.adamw_mode(), options.amsgrad(),
      options.maximize());

  const int64_t n = p.numel();
  const int64_t chunks = (n + kChunkAlign - 1) / kChunkAlign;
  at::parallel_for(0, chunks, kGrainElements / kChunkAlign, [&](int64_t c0, int64_t c1) {
    k::adam_step(h, b, c0 * kChunkAlign, std::min(n, c1 * kChunkAlign));
  });

  // The writes above bypass ATen, so record them the way in-place ops would:
  // autograd then catches a parameter saved for a backward that has not run yet.
  torch::autograd::impl::bump_version(p);
  torch::autograd::impl::bump_version(state.exp_avg());
  torch::autograd::impl::bump_version(state.exp_avg_sq());
  if (options.amsgrad()) torch::autograd::impl::bump_version(state.max_exp_avg_sq());
  if (out.defined()) torch::autograd::impl::bump_version(out);
}

void CPUAdam::update_with_tensor_ops(torch::Tensor& p, torch::Tensor grad,
                                     AdamParamState& state, const CPUAdamOptions& options,
                                     const torch::Tensor& out, const std::string& where) {
  TORCH_CHECK(c10::isFloatingType(p.scalar_type()),
              "CPUAdam: parameters must have a floating dtype", where);
  const bool upcast = p.scalar_type() == torch::kFloat32 &&
                      (grad.scalar_type() == torch::kBFloat16 ||
                       grad.scalar_type() == torch::kFloat16);
  TORCH_CHECK(grad.scalar_type() == p.scalar_type() || upcast,
              "CPUAdam: unsupported gradient dtype ", grad.scalar_type(), where,
              "; gradients must have the parameter's dtype (or bf16/fp16 for fp32 "
              "parameters)");
  if (upcast) grad = grad.to(torch::kFloat32);
  if (options.maximize()) grad = -grad;

  // From here on, line for line torch/csrc/api/src/optim/adam.cpp and adamw.cpp.
  auto& exp_avg = state.exp_avg();
  auto& exp_avg_sq = state.exp_avg_sq();
  auto& max_exp_avg_sq = state.max_exp_avg_sq();
  const double beta1 = std::get<0>(options.betas());
  const double beta2 = std::get<1>(options.betas());
  const double bias_correction1 = 1 - std::pow(beta1, state.step());
  const double bias_correction2 = 1 - std::pow(beta2, state.step());

  if (options.weight_decay() != 0) {
    if (options.adamw_mode()) {
      p.mul_(1 - options.lr() * options.weight_decay());
    } else {
      grad = grad.add(p, options.weight_decay());
    }
  }
  exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  torch::Tensor denom;
  if (options.amsgrad()) {
    torch::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq);
    denom = (max_exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
  } else {
    denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
  }
  const double step_size = options.lr() / bias_correction1;
  p.addcdiv_(exp_avg, denom, -step_size);

  if (out.defined()) out.view(p.sizes()).copy_(p);
}

void CPUAdam::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamParamState, CPUAdamOptions>(archive, *this);
}

void CPUAdam::load(torch::serialize::InputArchive& archive) {
  // Through our reader, not torch::optim::serialize: it also reads libtorch 1.x archives
  // (see optimizer_archive.h). Options come from the archive, but adamw_mode, maximize and
  // fused stay this optimizer's own unless the archive is a CPUAdam's (torch's Adam and
  // AdamW archives lack them).
  detail::OptimizerArchiveReaders read;
  read.state = [](torch::serialize::InputArchive& a) {
    auto state = std::make_unique<AdamParamState>();
    state->serialize(a);
    return std::unique_ptr<torch::optim::OptimizerParamState>(std::move(state));
  };
  read.options = [this](size_t g, torch::serialize::InputArchive& a) {
    auto& options = static_cast<CPUAdamOptions&>(param_groups_[g].options());
    c10::IValue own;
    const bool from_cpu_adam = a.try_read("adamw_mode", own);
    CPUAdamOptions loaded = options;
    loaded.serialize(a);
    if (!from_cpu_adam) loaded.adamw_mode(options.adamw_mode()).maximize(options.maximize()).fused(options.fused());
    check_options(loaded, " (param group " + std::to_string(g) + " of the loaded archive)");
    options = loaded;
  };
  detail::load_optimizer_archive(archive, *this, read);
}

void CPUAdam::set_copy_out(const torch::Tensor& param, torch::Tensor out) {
  TORCH_CHECK(param.defined() && out.defined(),
              "CPUAdam::set_copy_out: param and out must be defined tensors");
  bool found = false;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      found = found || p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl();
    }
  }
  TORCH_CHECK(found, "CPUAdam::set_copy_out: the tensor (sizes ", param.sizes(),
              ") is not a parameter of this optimizer; pass the tensor given at "
              "construction or to add_param_group");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat16,
              "CPUAdam::set_copy_out: out must be bf16 or fp16, got ", out.scalar_type());
  TORCH_CHECK(out.numel() == param.numel() && out.device() == param.device() &&
                  out.is_contiguous(),
              "CPUAdam::set_copy_out: out must be contiguous with the parameter's numel (",
              param.numel(), ") and device (", param.device(), "); got sizes ", out.sizes(),
              ", device ", out.device(), ", contiguous ", out.is_contiguous());
  {
    torch::NoGradGuard no_grad;
    out.view(param.sizes()).copy_(param);
  }
  copy_out_[param.unsafeGetTensorImpl()] = std::move(out);
}

void CPUAdam::clear_copy_out(const torch::Tensor& param) {
  copy_out_.erase(param.unsafeGetTensorImpl());
}

torch::Tensor CPUAdam::copy_out(const torch::Tensor& param) const {
  auto it = copy_out_.find(param.unsafeGetTensorImpl());
  return it == copy_out_.end() ? torch::Tensor() : it->second;
}

// ----------------------------------------------------------------------------
// copy_adam_state

namespace {

enum class AdamKind { kAdam, kAdamW };

AdamKind state_kind_of(const torch::optim::Optimizer& opt, const char* role) {
  if (dynamic_cast<const torch::optim::AdamW*>(&opt) != nullptr) return AdamKind::kAdamW;
  if (dynamic_cast<const torch::optim::Adam*>(&opt) != nullptr ||
      dynamic_cast<const CPUAdam*>(&opt) != nullptr) {
    return AdamKind::kAdam;
  }
  TORCH_CHECK(false, "copy_adam_state: the ", role,
              " optimizer must be a fsdp::optim::CPUAdam, torch::optim::Adam or "
              "torch::optim::AdamW");
}

struct AdamFields {
  int64_t step;
  torch::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
};

torch::Tensor clone_if_defined(const torch::Tensor& t) {
  return t.defined() ? t.clone() : torch::Tensor();
}

}  // namespace

void copy_adam_state(const torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  const AdamKind from_kind = state_kind_of(from, "source");
  const AdamKind to_kind = state_kind_of(to, "destination");
  const auto& from_groups = from.param_groups();
  auto& to_groups = to.param_groups();
  TORCH_CHECK(from_groups.size() == to_groups.size(), "copy_adam_state: the source has ",
              from_groups.size(), " param groups, the destination ", to_groups.size());
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < from_groups.size(); ++g) {
    const auto& src = from_groups[g].params();
    const auto& dst = to_groups[g].params();
    TORCH_CHECK(src.size() == dst.size(), "copy_adam_state: param group ", g, " has ",
                src.size(), " parameters in the source, ", dst.size(),
                " in the destination");
    for (size_t i = 0; i < src.size(); ++i) {
      TORCH_CHECK(src[i].sizes() == dst[i].sizes(), "copy_adam_state: parameter ", i,
                  " of param group ", g, " has sizes ", src[i].sizes(),
                  " in the source and ", dst[i].sizes(), " in the destination");
      auto it = from.state().find(param_state_key(src[i]));
      if (it == from.state().end()) {
        to.state().erase(param_state_key(dst[i]));
        continue;
      }
      AdamFields f;
      if (from_kind == AdamKind::kAdamW) {
        const auto& s = static_cast<const AdamWParamState&>(*it->second);
        f = {s.step(), s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()};
      } else {
        const auto& s = static_cast<const AdamParamState&>(*it->second);
        f = {s.step(), s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()};
      }
      std::unique_ptr<torch::optim::OptimizerParamState> copy;
      if (to_kind == AdamKind::kAdamW) {
        auto s = std::make_unique<AdamWParamState>();
        s->step(f.step);
        s->exp_avg(clone_if_defined(f.exp_avg));
        s->exp_avg_sq(clone_if_defined(f.exp_avg_sq));
        s->max_exp_avg_sq(clone_if_defined(f.max_exp_avg_sq));
        copy = std::move(s);
      } else {
        auto s = std::make_unique<AdamParamState>();
        s->step(f.step);
        s->exp_avg(clone_if_defined(f.exp_avg));
        s->exp_avg_sq(clone_if_defined(f.exp_avg_sq));
        s->max_exp_avg_sq(clone_if_defined(f.max_exp_avg_sq));
        copy = std::move(s);
      }
      to.state()[param_state_key(dst[i])] = std::move(copy);
    }
  }
}

}  // namespace optim
}  // namespace fsdp
