#pragma once
/// Entries of a torch::nn::ModuleList or ModuleDict as units: the model's forward calls
/// them through fsdp::call, which is the call site the library owns ([Note: wrap
/// candidates] in fsdp/core/wrappable.h).
///
///     for (size_t i = 0; i < blocks->size(); ++i) x = fsdp::call<BlockImpl>(blocks, i, x);
///     // was: x = blocks[i]->as<BlockImpl>()->forward(x);
///
/// Such entries are wrap candidates for path_policy, which names them ("blocks.*"); the
/// other policies leave them inside their parent's unit, as before, because a model that
/// calls its entries directly must keep working. An entry that became a unit must go through
/// fsdp::call in every forward: one that did not is named after the forward, with this fix.
/// Without FSDP (or for an entry that is no unit) fsdp::call is a plain call.

#include <string>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include "fsdp/core/wrappable.h"

namespace fsdp {

namespace core::detail {
/// The hooks of the unit FSDP made of `entry` (null: none). Process-wide; FSDP sets them
/// when it wraps a model and clears them when it is destroyed.
UnitHooks* entry_hooks(const torch::nn::Module* entry);
void set_entry_hooks(const torch::nn::Module* entry, UnitHooks* hooks);

template <typename Impl, typename... Args>
auto call_entry(const std::shared_ptr<torch::nn::Module>& entry, const std::string& where, Args&&... args) {
  auto* impl = entry ? entry->as<Impl>() : nullptr;
  TORCH_CHECK(impl != nullptr, "fsdp::call: ", where, " is ", entry ? entry->name() : std::string("empty"),
              ", not the type fsdp::call was given");
  return forward_through_hooks(
      entry_hooks(entry.get()), [impl](auto&&... a) { return impl->forward(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}
}  // namespace core::detail

/// Entry `i` of `list`, of type Impl, called with `args` (a unit's call site when FSDP made
/// the entry a unit).
template <typename Impl, typename... Args>
auto call(const torch::nn::ModuleList& list, size_t i, Args&&... args) {
  TORCH_CHECK(i < list->size(), "fsdp::call: index ", i, " of a ModuleList of ", list->size());
  return core::detail::call_entry<Impl>(list->ptr(i), "entry " + std::to_string(i), std::forward<Args>(args)...);
}

/// Entry `key` of `dict`, of type Impl, called with `args` (as above).
template <typename Impl, typename... Args>
auto call(const torch::nn::ModuleDict& dict, const std::string& key, Args&&... args) {
  TORCH_CHECK(dict->contains(key), "fsdp::call: the ModuleDict has no entry '", key, "'");
  return core::detail::call_entry<Impl>((*dict)[key], "entry '" + key + "'", std::forward<Args>(args)...);
}

}  // namespace fsdp
