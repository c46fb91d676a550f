#pragma once
/// [Note: wrap candidates]
/// The C++ frontend has no module hooks and `forward` is not virtual: a parent
/// calls its children directly. A unit boundary therefore needs a call site the
/// library owns. Two kinds of places can become units ("wrap candidates"):
///  * every entry of a torch::nn::Sequential whose forward maps Tensor -> Tensor:
///    FSDP swaps the Sequential's AnyModule entry for an adapter (the registered
///    child stays the user's module, so names do not change): no code change;
///  * a member declared through fsdp::Wrappable<Impl> instead of Impl's holder:
///        fsdp::Wrappable<BlockImpl> block{nullptr};        // was: Block block{nullptr};
///        block = register_module("block", fsdp::Wrappable<BlockImpl>(cfg));
///    WrappableImpl<Impl> *is an* Impl (same parameters, same names); its forward
///    calls the unit's hooks around Impl::forward when FSDP made it a unit and is
///    a plain call otherwise;
///  * for path_policy, every entry of a torch::nn::ModuleList or ModuleDict: the
///    model's forward calls it through fsdp::call (fsdp/core/call.h), the call site.
///    Other policies skip them, since a forward may call its entries directly.
/// The wrap policy (options.h) decides which candidates become units.
/// Every wrap candidate that is a Wrappable is also a checkpoint candidate
/// (fsdp/autograd/checkpoint_wrapper.h): once apply_activation_checkpointing chose
/// it, its forward (the unit's hooks included) runs inside fsdp::checkpoint.
/// A Wrappable is also a construction point: inside a ShardedInitContext it is
/// sharded when its constructor returns ([Note: sharded construction] in
/// sharded_init.h).

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/autograd/checkpoint_wrapper.h"

namespace fsdp {

/// The interception interface a unit exposes to its call site.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  /// Before the unit's forward: gather its parameters.
  virtual void pre_forward() = 0;
  /// After it, with every tensor the forward returned: reshard, and arm the
  /// hooks that re-gather before the unit's backward.
  virtual void post_forward(const std::vector<at::Tensor>& outputs) = 0;
  /// Dtype floating-point tensor arguments are cast to before the forward
  /// (mixed precision's cast_forward_inputs); none: passed unchanged.
  virtual std::optional<at::ScalarType> forward_input_dtype() const { return std::nullopt; }
};

namespace core::detail {
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... xs) { (collect_tensors(xs, out), ...); }, t);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
/// Values that hold no tensors.
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}

/// A forward argument cast to `dtype` when it is a floating-point tensor of
/// another dtype; anything else is forwarded unchanged.
template <typename T>
decltype(auto) cast_forward_input(T&& v, std::optional<at::ScalarType> dtype) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    if (dtype && v.defined() && v.is_floating_point() && v.scalar_type() != *dtype)
      return at::Tensor(v.to(*dtype));
    return at::Tensor(std::forward<T>(v));
  } else {
    return std::forward<T>(v);
  }
}

/// A unit's call site: `forward(args...)` between the unit's hooks (the arguments cast as
/// the unit asks), or a plain call when `hooks` is null (not a unit).
template <typename Fn, typename... Args>
auto forward_through_hooks(UnitHooks* hooks, Fn&& forward, Args&&... args) {
  if (hooks == nullptr) return forward(std::forward<Args>(args)...);
  hooks->pre_forward();
  const auto dtype = hooks->forward_input_dtype();
  auto out = forward(cast_forward_input(std::forward<Args>(args), dtype)...);
  std::vector<at::Tensor> tensors;
  collect_tensors(out, tensors);
  hooks->post_forward(tensors);
  return out;
}

}  // namespace core::detail

namespace core::detail {
struct ConstructionUnits;
}  // namespace core::detail

/// Base of every Wrappable: where FSDP plugs the unit's hooks in.
class WrappableBase : public CheckpointableBase {
 public:
  virtual ~WrappableBase() = default;
  UnitHooks* fsdp_unit_hooks() const { return hooks_; }
  void set_fsdp_unit_hooks(UnitHooks* hooks) { hooks_ = hooks; }
  /// Units a ShardedInitContext sharded when this module's constructor returned,
  /// until FullyShardedDataParallel adopts them (src/core/sharded_init_state.h).
  std::shared_ptr<core::detail::ConstructionUnits>& fsdp_construction_units() { return construction_; }

 private:
  UnitHooks* hooks_ = nullptr;  // owned by the FSDP runtime; null when not a unit
  std::shared_ptr<core::detail::ConstructionUnits> construction_;
};

namespace core::detail {
/// Called by every WrappableImpl when its constructor returns: shards it when a
/// ShardedInitContext is alive on this thread, otherwise does nothing.
void on_wrappable_constructed(torch::nn::Module& module, WrappableBase& base);

template <typename Self, typename... Args>
constexpr bool is_copy_of() {
  if constexpr (sizeof...(Args) == 1) return (std::is_same_v<std::decay_t<Args>, Self> && ...);
  return false;
}
}  // namespace core::detail

template <typename Impl>
class WrappableImpl : public Impl, public WrappableBase {
 public:
  /// Impl's constructors, followed by the construction point.
  template <typename... Args,
            typename = std::enable_if_t<std::is_constructible_v<Impl, Args&&...> &&
                                        !core::detail::is_copy_of<WrappableImpl, Args...>()>>
  explicit WrappableImpl(Args&&... args) : Impl(std::forward<Args>(args)...) {
    core::detail::on_wrappable_constructed(*this, *this);
  }

  template <typename... Args>
  auto forward(Args&&... args) {
    if (!activation_checkpointed()) return unit_forward(std::forward<Args>(args)...);
    return checkpoint([this](auto&&... a) { return unit_forward(std::forward<decltype(a)>(a)...); },
                      std::forward<Args>(args)...);
  }

 private:
  template <typename... Args>
  auto unit_forward(Args&&... args) {
    return core::detail::forward_through_hooks(
        fsdp_unit_hooks(), [this](auto&&... a) { return this->Impl::forward(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }
};

/// Module holder for a wrap candidate (see the note above).
template <typename Impl>
class Wrappable : public torch::nn::ModuleHolder<WrappableImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<WrappableImpl<Impl>>::ModuleHolder;
};

}  // namespace fsdp
