// See [Note: shared-memory progress engine] in shm_engine.h.
#include "shm_engine.h"

#include <algorithm>

#include "shm_arena.h"
#include "shm_channel.h"

namespace fsdp::comm::detail {

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

std::shared_ptr<ShmArena> ShmEngine::own_arena_locked(std::string* why) {
  if (!own_arena_ && !own_arena_failed_) {
    own_arena_ = ShmArena::create(why);
    own_arena_failed_ = own_arena_ == nullptr;
  } else if (own_arena_failed_) {
    *why = "this rank could not create its exchange arena earlier";
  }
  return own_arena_;
}

std::shared_ptr<ShmArena> ShmEngine::peer_arena_locked(int pid, int fd, uint64_t nonce, std::string* why) {
  auto& slot = peer_arenas_[nonce];
  auto a = slot.lock();
  if (!a) {
    a = ShmArena::open(pid, fd, nonce, why);
    slot = a;
  }
  return a;
}

}  // namespace fsdp::comm::detail
