// The registry behind fsdp::call (include/fsdp/core/call.h): which ModuleList and
// ModuleDict entries are units, and their hooks.
#include <mutex>
#include <unordered_map>

#include "fsdp/core/call.h"

namespace fsdp::core::detail {

namespace entry_hooks_detail {

struct Registry {
  std::mutex mu;
  std::unordered_map<const torch::nn::Module*, UnitHooks*> hooks;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace entry_hooks_detail

UnitHooks* entry_hooks(const torch::nn::Module* entry) {
  auto& r = entry_hooks_detail::registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.hooks.find(entry);
  return it == r.hooks.end() ? nullptr : it->second;
}

void set_entry_hooks(const torch::nn::Module* entry, UnitHooks* hooks) {
  auto& r = entry_hooks_detail::registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (hooks) r.hooks[entry] = hooks;
  else r.hooks.erase(entry);
}

}  // namespace fsdp::core::detail
