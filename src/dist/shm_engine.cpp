// See [Note: shared-memory progress engine] in shm_engine.h.
#include "shm_engine.h"

#include <algorithm>

#include "shm_channel.h"

namespace fsdp::dist::detail {

void ShmEngine::add_locked(ShmChannel* channel) { channels_.push_back(channel); }

void ShmEngine::remove_locked(ShmChannel* channel) {
  channels_.erase(std::remove(channels_.begin(), channels_.end(), channel), channels_.end());
}

bool ShmEngine::progress_locked() {
  bool moved = false;
  for (auto* c : channels_) moved |= c->progress_locked();
  return moved;
}

bool ShmEngine::pending_locked(const ShmChannel* except) const {
  for (auto* c : channels_) {
    if (c != except && c->pending_locked()) return true;
  }
  return false;
}

bool ShmEngine::progress() {
  std::lock_guard<std::mutex> lock(mu_);
  return progress_locked();
}

bool ShmEngine::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_locked();
}

}  // namespace fsdp::dist::detail
