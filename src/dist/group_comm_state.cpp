// See [Note: per-group comm state] in group_comm_state.h.
#include "group_comm_state.h"

#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace fsdp::dist::detail {

namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> owner;
  uint32_t next_tag = 0;
  at::Tensor idle;  // undefined when leased out or never needed
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10d::ProcessGroup*, Entry> entries;

  // Caller holds mu. Drops dead groups first: a new group may reuse a dead one's
  // address, and must not inherit its tags or buffer.
  Entry& entry(const ProcessGroup& g) {
    for (auto it = entries.begin(); it != entries.end();) {
      it = it->second.owner.expired() ? entries.erase(it) : std::next(it);
    }
    const auto& pg = g.c10d();
    auto it = entries.find(pg.get());
    if (it == entries.end()) {
      it = entries.emplace(pg.get(), Entry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg)}).first;
    }
    return it->second;
  }
};

Registry& registry() {
  static auto* r = new Registry();  // leaked: collectives may run during static teardown
  return *r;
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

}  // namespace

int reserve_tags(const ProcessGroup& g, int count) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& e = r.entry(g);
  // Gloo wants tags >= 0; wrap well below INT_MAX. Tags of finished calls are free
  // again long before the counter comes back to them.
  constexpr uint32_t kWrap = 1u << 30;
  if (e.next_tag + static_cast<uint32_t>(count) >= kWrap) e.next_tag = 0;
  const int first = static_cast<int>(e.next_tag);
  e.next_tag += static_cast<uint32_t>(count);
  return first;
}

at::Tensor acquire_scratch(const ProcessGroup& g, int64_t bytes) {
  if (bytes >= kCacheMinBytes) {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto& e = r.entry(g);
    if (e.idle.defined() && nbytes(e.idle) >= bytes) {
      return std::move(e.idle);  // leaves e.idle undefined: leased
    }
  }
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
}

void release_scratch(const ProcessGroup& g, at::Tensor buffer) {
  if (!buffer.defined() || nbytes(buffer) < kCacheMinBytes) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& e = r.entry(g);
  if (!e.idle.defined() || nbytes(e.idle) < nbytes(buffer)) e.idle = std::move(buffer);
}

int64_t cached_scratch_bytes() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  int64_t total = 0;
  for (auto& [key, e] : r.entries) {
    if (!e.owner.expired() && e.idle.defined()) total += nbytes(e.idle);
  }
  return total;
}

}  // namespace fsdp::dist::detail
