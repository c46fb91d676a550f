#include "counting_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "fsdp/comm/collectives.h"

namespace fsdp::memory {
namespace {
// Set once, before the counter becomes the CPU allocator: release() finds it here, since a
// DataPtr's deleter is a plain function.
std::atomic<CountingAllocator*> installed_counter{nullptr};
}  // namespace

c10::DataPtr CountingAllocator::allocate(size_t n) {
  const int64_t limit = limit_.load();
  TORCH_CHECK_WITH(OutOfMemoryError, limit <= 0 || live_.load() + static_cast<int64_t>(n) <= limit,
                   "CountingAllocator: ", n, " bytes would exceed the limit of ", limit, " bytes");
  c10::DataPtr inner = base_->allocate(n);
  void* data = inner.get();
  const c10::Device device = inner.device();
  if (data == nullptr) return inner;  // zero bytes: nothing to count
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_.emplace(data, Block{std::move(inner), n});
  }
  add_live(static_cast<int64_t>(n));
  allocations_.fetch_add(1, std::memory_order_relaxed);
  return {data, data, &CountingAllocator::release, device};
}

c10::DeleterFnPtr CountingAllocator::raw_deleter() const { return &CountingAllocator::release; }

void CountingAllocator::add_external(int64_t delta) { add_live(delta); }

void CountingAllocator::add_live(int64_t delta) {
  const int64_t now = live_ += delta;
  int64_t seen = peak_.load();
  while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
  }
}

void CountingAllocator::release(void* data) {
  CountingAllocator* self = installed_counter.load();
  c10::DataPtr inner;  // freed after the lock is released
  {
    std::lock_guard<std::mutex> lock(self->mutex_);
    auto it = self->blocks_.find(data);
    if (it != self->blocks_.end()) {
      self->live_ -= static_cast<int64_t>(it->second.n);
      inner = std::move(it->second.inner);
      self->blocks_.erase(it);
      return;
    }
  }
  // A raw_allocate'd block from before counting started, returned through
  // Allocator::raw_deallocate of the current allocator (kernels keep scratch blocks): its own
  // allocator frees it.
  c10::DeleterFnPtr base_deleter = self->base_->raw_deleter();
  TORCH_INTERNAL_ASSERT(base_deleter != nullptr, "counting allocator: a block it did not allocate");
  base_deleter(data);
}

CountingAllocator* install_counting_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto* c = new CountingAllocator(c10::GetCPUAllocator());  // lives as long as the process
    installed_counter = c;  // before any block can be released through it
    c10::SetCPUAllocator(c, /*priority=*/100);
    c->add_external(comm::collective_buffer_bytes());
    comm::add_collective_buffer_observer([](int64_t delta) { installed_counter.load()->add_external(delta); });
  });
  return installed_counter.load();
}

CountingAllocator* installed_counting_allocator() { return installed_counter.load(); }

}  // namespace fsdp::memory
