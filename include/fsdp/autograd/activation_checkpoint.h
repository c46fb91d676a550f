#pragma once
/// [Note: activation checkpoint]
/// fsdp::checkpoint(fn, args...) runs fn(args...) without keeping its activations: the
/// first forward runs without grad and saves only the tensor arguments; when backward
/// reaches the result, fn runs again with grad (the *recompute*) and a nested backward
/// through what it recomputed delivers the gradients of the arguments and of every
/// parameter fn used. libtorch's saved-tensor hooks exist only in Python, so this is the
/// reentrant kind ([Note: nested backward] in end_of_backward.h).
///  * Random numbers: the CPU generator's state (and that of every CUDA device an argument
///    lives on) is captured before the first forward and installed for the recompute, then
///    the states from before it are put back: dropout recomputes bit for bit, and after
///    backward the stream is where a run without the checkpoint leaves it.
///  * Arguments: tensors and std::vector<at::Tensor> travel through the checkpoint (their
///    gradients flow back); any other argument (int, bool, a struct) is copied and passed
///    again, unchanged, to the recompute. Arguments that do not require grad work; even if
///    none does, the parameters fn uses get gradients.
///  * Result: at::Tensor, std::vector<at::Tensor> or std::tuple of at::Tensor.
///  * fn must compute the same thing when called again with the same arguments (no state
///    that changes between calls other than the random generators). Nested checkpoints work.
///  * Under no grad (evaluation) fn is simply called.
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp {

namespace autograd::detail {

using TensorFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
/// The checkpoint on a flat list of tensors (what checkpoint() below reduces to).
std::vector<at::Tensor> checkpoint_tensors(TensorFn fn, const std::vector<at::Tensor>& inputs);

template <typename T>
constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;
template <typename T>
constexpr bool is_tensor_list_v = std::is_same_v<std::decay_t<T>, std::vector<at::Tensor>>;

template <typename T>
void collect_argument(const T& arg, std::vector<at::Tensor>& out) {
  if constexpr (is_tensor_v<T>) out.push_back(arg);
  else if constexpr (is_tensor_list_v<T>) out.insert(out.end(), arg.begin(), arg.end());
}

/// What the recompute keeps of an argument: nothing of a tensor (it is saved by the
/// checkpoint), a copy of anything else.
template <typename T>
std::decay_t<T> keep_argument(const T& arg) {
  if constexpr (is_tensor_v<T>) return at::Tensor();
  else if constexpr (is_tensor_list_v<T>) return std::vector<at::Tensor>(arg.size());
  else return arg;
}

/// The argument for the recompute: the next tensor(s) of `tensors`, or the kept copy.
template <typename T>
T rebuild_argument(const T& kept, const std::vector<at::Tensor>& tensors, size_t& next) {
  if constexpr (is_tensor_v<T>) {
    return tensors.at(next++);
  } else if constexpr (is_tensor_list_v<T>) {
    std::vector<at::Tensor> list(tensors.begin() + next, tensors.begin() + next + kept.size());
    next += kept.size();
    return list;
  } else {
    return kept;
  }
}

inline void flatten_result(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void flatten_result(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... Ts>
void flatten_result(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  static_assert((is_tensor_v<Ts> && ...), "fsdp::checkpoint: a tuple result must hold at::Tensor only");
  std::apply([&](const auto&... xs) { (out.push_back(xs), ...); }, t);
}

template <typename R>
struct ResultOf;
template <>
struct ResultOf<at::Tensor> {
  static at::Tensor from(std::vector<at::Tensor> ts) { return ts.at(0); }
};
template <>
struct ResultOf<std::vector<at::Tensor>> {
  static std::vector<at::Tensor> from(std::vector<at::Tensor> ts) { return ts; }
};
template <typename... Ts>
struct ResultOf<std::tuple<Ts...>> {
  static std::tuple<Ts...> from(std::vector<at::Tensor> ts) {
    return from(ts, std::index_sequence_for<Ts...>{});
  }
  template <size_t... I>
  static std::tuple<Ts...> from(const std::vector<at::Tensor>& ts, std::index_sequence<I...>) {
    return std::tuple<Ts...>(ts.at(I)...);
  }
};

}  // namespace autograd::detail

/// fn(args...) with its activations recomputed in backward instead of kept
/// ([Note: activation checkpoint]).
template <typename F, typename... Args>
auto checkpoint(F fn, Args&&... args) {
  namespace d = autograd::detail;
  using R = std::decay_t<std::invoke_result_t<F&, std::decay_t<Args>&...>>;
  if (!at::GradMode::is_enabled()) return R(fn(args...));
  std::vector<at::Tensor> tensors;
  (d::collect_argument(args, tensors), ...);
  auto kept = std::make_shared<std::tuple<std::decay_t<Args>...>>(d::keep_argument(args)...);
  d::TensorFn run = [fn, kept](const std::vector<at::Tensor>& ts) mutable {
    std::vector<at::Tensor> out;
    std::apply(
        [&](const auto&... k) {
          size_t next = 0;
          // A braced list evaluates left to right: tensors are handed out in argument order.
          std::tuple<std::decay_t<Args>...> rebuilt{d::rebuild_argument(k, ts, next)...};
          d::flatten_result(std::apply(fn, rebuilt), out);
        },
        *kept);
    return out;
  };
  return d::ResultOf<R>::from(d::checkpoint_tensors(std::move(run), tensors));
}

}  // namespace fsdp
