// fsdp::optim::CPUAdam: fused, vectorised, multi-threaded Adam/AdamW for CPU tensors.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace fsdp {
namespace optim {

/// Options of CPUAdam: those of torch::optim::AdamOptions (same names, defaults
/// and serialized keys) plus `adamw_mode`, `maximize` and `fused`.
///
///     fsdp::optim::CPUAdam opt(model->parameters(),
///         fsdp::optim::CPUAdamOptions(1e-3).weight_decay(0.01).adamw_mode(true));
struct CPUAdamOptions : public torch::optim::OptimizerCloneableOptions<CPUAdamOptions> {
  CPUAdamOptions(double lr = 1e-3);  // NOLINT: implicit like torch::optim::AdamOptions
  /// Same hyper-parameters as a torch::optim::AdamOptions (adamw_mode false).
  explicit CPUAdamOptions(const torch::optim::AdamOptions& adam);
  /// Same hyper-parameters as a torch::optim::AdamWOptions (adamw_mode true).
  explicit CPUAdamOptions(const torch::optim::AdamWOptions& adamw);

  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  /// Adam: added to the gradient as weight_decay * param (L2 penalty).
  /// AdamW (adamw_mode): param *= 1 - lr * weight_decay before the update.
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, amsgrad) = false;
  /// Decoupled weight decay, exactly torch::optim::AdamW. Note the default
  /// weight_decay stays 0 (AdamW's is 1e-2): set both.
  TORCH_ARG(bool, adamw_mode) = false;
  /// Ascend instead of descend: the gradient is negated first (PyTorch's
  /// `maximize`; libtorch 1.13's C++ Adam has no such option).
  TORCH_ARG(bool, maximize) = false;
  /// CPU tensors take the fused kernel when true. When false, or for tensors on
  /// another device, the update runs as libtorch's own sequence of tensor ops
  /// (same math, several passes over memory).
  TORCH_ARG(bool, fused) = true;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const CPUAdamOptions& lhs, const CPUAdamOptions& rhs);
  ~CPUAdamOptions() override = default;
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Adam/AdamW whose CPU update is one fused pass per parameter tensor.
///
/// Semantics: identical to torch::optim::Adam (adamw_mode false) and
/// torch::optim::AdamW (adamw_mode true) of libtorch 1.13, including the fp32
/// order of operations, so results agree to about one ulp per step.
///
/// State: the per-parameter state is a torch::optim::AdamParamState (step,
/// exp_avg, exp_avg_sq, max_exp_avg_sq) under the same key torch::optim::Adam
/// uses, so state moves freely between optimizers:
///  - torch::save(cpu_adam, path) is loadable by torch::load into a
///    torch::optim::Adam or AdamW over the same parameter groups, and the other
///    way round (only the state is loaded; options stay those of the receiver);
///  - state() entries can be copied directly to/from a torch::optim::Adam;
///  - copy_adam_state() converts between any of CPUAdam, Adam and AdamW in memory.
///
/// Fused path (CPU tensors, options.fused()): needs a contiguous fp32 parameter,
/// a contiguous gradient of dtype fp32, bf16 or fp16 (read as exact fp32, so a
/// low-precision gradient gives the same result as its fp32 upcast), and
/// contiguous fp32 state of the same size. Anything else is a c10::Error that
/// names the parameter and the fix (there is no silent slow path). The tensor is
/// split into chunks over at::parallel_for, so at::set_num_threads applies and the
/// result does not depend on the number of threads.
///
/// Fallback path (other devices, or fused(false)): any floating dtype, gradients
/// of the parameter's dtype (or bf16/fp16 for fp32 parameters, upcast first).
///
/// Sparse gradients are rejected. Parameters without a gradient are skipped.
class CPUAdam : public torch::optim::Optimizer {
 public:
  explicit CPUAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                   CPUAdamOptions defaults = {});
  explicit CPUAdam(std::vector<torch::Tensor> params, CPUAdamOptions defaults = {});

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Low-precision copy-out: after each step that updates `param`, its new value
  /// is also written to `out` (bf16 or fp16, same numel and device, contiguous),
  /// rounded to nearest even, i.e. bit-equal to param.to(out.scalar_type()). On
  /// the fused path this costs one extra write in the same pass, no extra read.
  /// `out` is filled from `param` immediately, so it is valid before the first
  /// step. `param` must be one of this optimizer's parameters. Replaces an
  /// earlier copy-out of the same parameter. Not part of save()/load().
  void set_copy_out(const torch::Tensor& param, torch::Tensor out);
  /// Stops writing the copy-out of `param` (no-op if it has none).
  void clear_copy_out(const torch::Tensor& param);
  /// The copy-out tensor of `param`, or an undefined tensor.
  torch::Tensor copy_out(const torch::Tensor& param) const;

 private:
  void update_fused(torch::Tensor& param, const torch::Tensor& grad,
                    torch::optim::AdamParamState& state, const CPUAdamOptions& options,
                    const torch::Tensor& out, const std::string& where);
  void update_with_tensor_ops(torch::Tensor& param, torch::Tensor grad,
                              torch::optim::AdamParamState& state,
                              const CPUAdamOptions& options, const torch::Tensor& out,
                              const std::string& where);

  // Keyed like state_: by the parameter's TensorImpl address.
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> copy_out_;
};

/// Copies the optimizer state of `from` into `to` (deep copy), matching
/// parameters by position in their groups: group i, parameter j of `from` feeds
/// group i, parameter j of `to`. Each of `from` and `to` is a CPUAdam, a
/// torch::optim::Adam or a torch::optim::AdamW; the state class is converted
/// (AdamParamState <-> AdamWParamState). Options are not copied. Parameters
/// without state in `from` lose their state in `to`.
void copy_adam_state(const torch::optim::Optimizer& from, torch::optim::Optimizer& to);

}  // namespace optim
}  // namespace fsdp
