#pragma once
// Internal to src/comm: the progress engine of the shared-memory channels of one world.
//
// [Note: shared-memory progress engine]
// The shared-memory transport has no thread: an operation moves only while some thread of
// its process issues or waits (see [Note: shared-memory transport] in shm_channel.cpp).
// A rank blocked on group A must therefore keep moving its pending operations on group B,
// or a peer that waits on B before it gets to A never gets there, and both hang. The
// engine is the one place that knows every live channel: any wait (a shared-memory wait,
// or a Gloo wait while shared-memory operations are pending, gloo_transport.cpp) moves
// the pending operations of every channel in issue order, as one progress thread would.
//
// Ownership: init_process_group creates one engine per world when shared memory is on;
// the world group's state keeps it and hands it to every sub-group it creates, and the
// transports of those groups (the channels and the Gloo waits) hold it. So the guarantee
// above covers every group derived from one init_process_group, which is every group of a
// job; the engine lives as long as the last transport that uses it.
//
// One lock serialises the channels' state and the progress of all of them; collectives
// are issued from one thread anyway.
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::comm::detail {

class ShmArena;
class ShmChannel;

class ShmEngine {
 public:
  ShmEngine() = default;
  ShmEngine(const ShmEngine&) = delete;
  ShmEngine& operator=(const ShmEngine&) = delete;

  /// Guards every registered channel's state; the *_locked calls need it held.
  std::mutex& mutex() { return mu_; }

  void add_locked(ShmChannel* channel);
  void remove_locked(ShmChannel* channel);
  /// Moves every channel's pending operations as far as they go without blocking; true if
  /// anything moved.
  bool progress_locked();
  /// True while some channel other than `except` has an operation not yet complete.
  bool pending_locked(const ShmChannel* except = nullptr) const;

  /// The same two, taking the lock (for waits outside the shared-memory transport).
  bool progress();
  bool pending();

  /// This process's exchange arena ([Note: exchange arena] in shm_arena.cpp), created on
  /// first use; nullptr (and `why`) when /dev/shm cannot hold it.
  std::shared_ptr<ShmArena> own_arena_locked(std::string* why);
  /// A peer's exchange arena, mapped once per process while some channel holds it.
  std::shared_ptr<ShmArena> peer_arena_locked(int pid, int fd, uint64_t nonce, std::string* why);

 private:
  std::mutex mu_;
  std::vector<ShmChannel*> channels_;  // live channels; each removes itself when destroyed
  std::shared_ptr<ShmArena> own_arena_;
  bool own_arena_failed_ = false;
  std::map<uint64_t, std::weak_ptr<ShmArena>> peer_arenas_;  // by nonce, which names an arena
};

}  // namespace fsdp::comm::detail
