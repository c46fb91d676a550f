#pragma once
/// The module form of fsdp::checkpoint ([Note: activation checkpoint] in
/// activation_checkpoint.h). The C++ frontend has no module hooks and forward is not
/// virtual, so a module is checkpointed at a call site the library owns, as FSDP's units
/// are ([Note: wrap candidates] in fsdp/core/wrappable.h):
///  * a member declared through fsdp::Checkpointable<Impl> (is an Impl: same parameters,
///    same names), or through fsdp::Wrappable<Impl> (every wrap candidate is also a
///    checkpoint candidate);
///  * apply_activation_checkpointing(model, check_fn) turns checkpointing on for the
///    candidates check_fn accepts (by module type: checkpoint_module_type<Impl>()).
/// Under FSDP a Wrappable that is both a unit and checkpointed runs its unit inside the
/// checkpoint: the unit's forward is recomputed in backward.
#include <functional>
#include <string>
#include <utility>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/autograd/activation_checkpoint.h"

namespace fsdp {

/// Base of every checkpoint candidate: whether its forward runs through fsdp::checkpoint.
class CheckpointableBase {
 public:
  virtual ~CheckpointableBase() = default;
  bool activation_checkpointed() const { return checkpointed_; }
  void set_activation_checkpointed(bool on) { checkpointed_ = on; }

 private:
  bool checkpointed_ = false;
};

template <typename Impl>
class CheckpointableImpl : public Impl, public CheckpointableBase {
 public:
  using Impl::Impl;

  template <typename... Args>
  auto forward(Args&&... args) {
    if (!activation_checkpointed()) return Impl::forward(std::forward<Args>(args)...);
    return checkpoint([this](auto&&... a) { return Impl::forward(std::forward<decltype(a)>(a)...); },
                      std::forward<Args>(args)...);
  }
};

/// Module holder for a checkpoint candidate outside FSDP.
template <typename Impl>
class Checkpointable : public torch::nn::ModuleHolder<CheckpointableImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<CheckpointableImpl<Impl>>::ModuleHolder;
};

/// Chooses checkpoint candidates: (path of the module in the model, the module).
using CheckpointPolicy = std::function<bool(const std::string& path, torch::nn::Module& module)>;

/// Turns checkpointing on for every candidate in `model` (itself included) that `check_fn`
/// accepts. Returns how many. Fails when check_fn accepts a module that is no candidate.
int apply_activation_checkpointing(torch::nn::Module& model, const CheckpointPolicy& check_fn);

/// A policy accepting the modules of type Impl (e.g. a transformer block).
template <typename Impl>
CheckpointPolicy checkpoint_module_type() {
  return [](const std::string&, torch::nn::Module& m) { return dynamic_cast<Impl*>(&m) != nullptr; };
}

}  // namespace fsdp
