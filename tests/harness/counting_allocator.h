#pragma once
// A CPU allocator that forwards to libtorch's and counts live and peak bytes, so
// memory tests see every buffer a library keeps, not only what it reports.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace fsdp::testing {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) const override {
    auto* ctx = new Context{base_->allocate(n), n, this};
    live_ += static_cast<int64_t>(n);
    peak_ = std::max(peak_.load(), live_.load());
    void* data = ctx->inner.get();
    return {data, ctx, &CountingAllocator::release, ctx->inner.device()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_.load(); }

 private:
  struct Context {
    c10::DataPtr inner;
    size_t n;
    const CountingAllocator* self;
  };
  static void release(void* p) {
    auto* ctx = static_cast<Context*>(p);
    ctx->self->live_ -= static_cast<int64_t>(ctx->n);
    delete ctx;
  }
  c10::Allocator* base_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

/// Installs the counter as the process's CPU allocator once (tensors allocated
/// before are freed through their own deleters and never counted).
inline CountingAllocator* install_counting_allocator() {
  static CountingAllocator* counter = [] {
    auto* c = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(c, /*priority=*/100);
    return c;
  }();
  return counter;
}

}  // namespace fsdp::testing
