#pragma once
// A CPU allocator that forwards to libtorch's and counts live and peak bytes, so
// memory tests see every buffer a library keeps, not only what it reports.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "fsdp/comm/collectives.h"

namespace fsdp::testing {

// The DataPtr it returns has the data pointer as its context, as ATen's scratch
// allocations through Allocator::raw_allocate require (GELU's kernel asserts it),
// so the inner DataPtr and the size are kept in a table keyed by the pointer.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) { instance() = this; }
  c10::DataPtr allocate(size_t n) override {
    // A memory cap for out-of-memory tests, failing as a device allocator does.
    const int64_t limit = limit_.load();
    TORCH_CHECK_WITH(OutOfMemoryError, limit <= 0 || live_.load() + static_cast<int64_t>(n) <= limit,
                     "CountingAllocator: ", n, " bytes would exceed the test's limit of ", limit, " bytes");
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    if (data == nullptr) return inner;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.emplace(data, Block{std::move(inner), n});
    }
    live_ += static_cast<int64_t>(n);
    int64_t seen = peak_.load();
    while (live_.load() > seen && !peak_.compare_exchange_weak(seen, live_.load())) {
    }
    return {data, data, &CountingAllocator::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  // Blocks of the exchange arena (comm::allocate_collective_buffer): host memory the
  // library keeps like any other, counted alike (install_counting_allocator wires it).
  void add_external(int64_t delta) const {
    live_ += delta;
    int64_t seen = peak_.load();
    while (live_.load() > seen && !peak_.compare_exchange_weak(seen, live_.load())) {
    }
  }
  static void observe_external(int64_t delta) { instance()->add_external(delta); }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_.load(); }
  /// Allocations beyond `bytes` live bytes throw c10::OutOfMemoryError; 0: no limit.
  void set_limit(int64_t bytes) { limit_ = bytes; }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t n;
  };
  std::atomic<int64_t> limit_{0};
  static CountingAllocator*& instance() {
    static CountingAllocator* self = nullptr;
    return self;
  }
  static void release(void* data) {
    CountingAllocator* self = instance();
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
    // A raw_allocate'd block from before the counter was installed, returned
    // through raw_deallocate of the current allocator: its own allocator frees it.
    self->base_->raw_deleter()(data);
  }
  c10::Allocator* base_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Block> blocks_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

/// Installs the counter as the process's CPU allocator once (tensors allocated
/// before are freed through their own deleters and never counted).
inline CountingAllocator* install_counting_allocator() {
  static CountingAllocator* counter = [] {
    auto* c = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(c, /*priority=*/100);
    c->add_external(comm::collective_buffer_bytes());
    comm::add_collective_buffer_observer(&CountingAllocator::observe_external);
    return c;
  }();
  return counter;
}

}  // namespace fsdp::testing
