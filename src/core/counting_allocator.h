#pragma once
// The counting CPU allocator: forwards to the allocator it replaces and counts live bytes, their
// peak and the allocations made. The memory tracer's "other" category reads it
// (enable_allocator_counting), and the memory tests read it to see every buffer the library
// keeps, not only what the library reports.
//
// The DataPtr it returns has the data pointer as its context (some kernels allocate through
// Allocator::raw_allocate, which requires that: GELU's asserts it), so the inner DataPtr and the
// size are kept in a table keyed by the data pointer. Blocks of the exchange arena
// (comm::allocate_collective_buffer) are host memory the library keeps like any other: they are
// counted alike, through the arena's observer.
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>

namespace fsdp::memory {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t live() const { return live_.load(); }
  /// The most live bytes since the counter was installed or reset_peak() last ran.
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_ = live_.load(); }
  /// Allocations made through it so far: what its cost scales with.
  int64_t allocations() const { return allocations_.load(std::memory_order_relaxed); }
  /// Bytes held outside it that count as live all the same (the exchange arena's blocks).
  void add_external(int64_t delta);
  /// Allocations beyond `bytes` live bytes throw c10::OutOfMemoryError, as a device allocator
  /// does when full: how the out-of-memory tests cap host memory. 0: no limit.
  void set_limit(int64_t bytes) { limit_ = bytes; }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t n;
  };
  static void release(void* data);
  void add_live(int64_t delta);
  c10::Allocator* base_;
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> limit_{0};
};

/// Installs a CountingAllocator as the process's CPU allocator, once (later calls return the same
/// one); it lives as long as the process. Tensors allocated before are freed through their own
/// deleters and never counted, so install it before building the model.
CountingAllocator* install_counting_allocator();
/// The installed counter, nullptr before install_counting_allocator().
CountingAllocator* installed_counting_allocator();

}  // namespace fsdp::memory
