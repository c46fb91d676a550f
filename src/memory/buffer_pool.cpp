#include "buffer_pool.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>

#include "tensor_on_memory.h"

namespace fsdp::memory {

struct BufferPool::State {
  struct Block {
    at::DataPtr mem;  // from the block allocator; freed when the Block dies
    size_t capacity = 0;
  };
  // What a handed-out DataPtr's deleter context points at.
  struct Lease {
    std::weak_ptr<State> pool;
    Block block;
  };

  int max_idle;
  size_t min_block_bytes;
  std::function<at::DataPtr(size_t)> allocate_block;  // host blocks; empty: the CPU allocator
  std::function<void(const at::DataPtr&)> on_new_block;
  mutable std::mutex mu;
  std::vector<Block> idle;

  at::DataPtr new_block(size_t nbytes, at::Device device) const {
    if (!device.is_cpu()) {
      const c10::DeviceGuard on(device);  // the allocator serves the current device
      return c10::GetAllocator(device.type())->allocate(nbytes);
    }
    return allocate_block ? allocate_block(nbytes) : c10::GetAllocator(c10::DeviceType::CPU)->allocate(nbytes);
  }

  void give_back(Block b) {
    std::lock_guard<std::mutex> lock(mu);
    const bool small = b.capacity < min_block_bytes && !allocate_block && b.mem.device().is_cpu();
    if (small || static_cast<int>(idle.size()) >= max_idle) return;  // b frees
    idle.push_back(std::move(b));
  }

  static void return_lease(void* ctx) {
    std::unique_ptr<Lease> lease(static_cast<Lease*>(ctx));
    // The deleter may run on any thread (Gloo's worker drops its references
    // to finished collectives' tensors there); give_back locks.
    if (auto pool = lease->pool.lock()) pool->give_back(std::move(lease->block));
  }
};

BufferPool::BufferPool(int max_idle, int64_t min_block_bytes) : state_(std::make_shared<State>()) {
  TORCH_INTERNAL_ASSERT(max_idle >= 0 && min_block_bytes >= 0);
  state_->max_idle = max_idle;
  state_->min_block_bytes = static_cast<size_t>(min_block_bytes);
}

at::DataPtr BufferPool::allocate(size_t nbytes, at::Device device) {
  State::Block block;
  std::function<void(const at::DataPtr&)> observer;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    observer = state_->on_new_block;
    auto& idle = state_->idle;
    auto best = idle.end();
    for (auto it = idle.begin(); it != idle.end(); ++it) {
      const bool fits = it->mem.device() == device && it->capacity >= nbytes && it->capacity < 2 * nbytes;
      if (fits && (best == idle.end() || it->capacity < best->capacity)) best = it;
    }
    if (best != idle.end()) {
      block = std::move(*best);
      idle.erase(best);
    }
  }
  if (!block.mem) {
    block.mem = state_->new_block(nbytes, device);
    block.capacity = nbytes;
    if (observer) observer(block.mem);
  }
  void* data = block.mem.get();
  const at::Device block_device = block.mem.device();
  auto* lease = new State::Lease{state_, std::move(block)};
  return at::DataPtr(data, lease, &State::return_lease, block_device);
}

at::Tensor BufferPool::empty(int64_t numel, const at::TensorOptions& options) {
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  return tensor_on_memory(allocate(nbytes, options.device()), {numel}, options);
}

void BufferPool::set_block_allocator(std::function<at::DataPtr(size_t)> allocate_block) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->allocate_block = std::move(allocate_block);
}

void BufferPool::set_new_block_observer(std::function<void(const at::DataPtr&)> observer) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->on_new_block = std::move(observer);
}

int64_t BufferPool::idle_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  int64_t b = 0;
  for (const auto& blk : state_->idle) b += static_cast<int64_t>(blk.capacity);
  return b;
}

void BufferPool::release_idle() {
  std::vector<State::Block> drop;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    drop.swap(state_->idle);
  }
  // Freed here, outside the lock.
}

}  // namespace fsdp::memory
