#pragma once
// Internal to src/comm: the shared-memory transport of a process group whose ranks all
// run on one host. See [Note: shared-memory transport] in shm_channel.cpp.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/group_desc.h"
#include "fsdp/comm/types.h"
#include "shm_ring_layout.h"

namespace fsdp::comm::detail {

struct ShmOp;
struct ShmSegment;

class ShmArena;
class ShmEngine;
class ShmHandshake;

/// One group's rings: this rank's (it writes) and every peer's (it reads). Issue calls
/// copy what fits into this rank's ring at once and return; ShmChannel::wait moves the
/// rest. Calls on one channel must be issued in the same order on every member, like
/// every collective. Not thread-safe on its own: every entry point takes the lock of the
/// engine the channel is registered with (shm_engine.h).
class ShmChannel {
 public:
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  /// flat[r*chunk:(r+1)*chunk] = shard of rank r.
  std::shared_ptr<ShmOp> all_gather(const at::Tensor& flat, const at::Tensor& shard);
  /// out = sum (or mean) over ranks of flat[rank*chunk:(rank+1)*chunk], in rank order.
  /// `out` must not overlap `flat` (ShmTransport reduces into a temporary then).
  std::shared_ptr<ShmOp> reduce_scatter(const at::Tensor& out, const at::Tensor& flat, ReduceOp op);
  /// In place: a reduce-scatter of near-equal chunks, then an all-gather of the results.
  std::shared_ptr<ShmOp> all_reduce(const at::Tensor& t, ReduceOp op);
  /// Blocks until `op` is complete, moving the pending operations of every channel of the
  /// engine meanwhile.
  /// Throws c10::Error naming the operation, the group and the peer waited on when a peer
  /// exits or gives up, or after the group's timeout.
  void wait(ShmOp& op);

  int rank() const { return rank_; }
  int size() const { return size_; }

  /// Memory in this process's exchange arena, which every peer of the channel has mapped:
  /// collectives whose source lies there are read by the peers in place ([Note: exchange
  /// arena] in shm_arena.cpp). An empty DataPtr when the channel copies through its rings
  /// only (FSDP_SHM_DIRECT=0, or some member could not map some arena) or the arena is full.
  at::DataPtr allocate_direct(size_t nbytes);
  /// Every member's exchange arena by group rank (this rank's included), or empty under
  /// the same conditions as allocate_direct's empty DataPtr.
  std::vector<std::shared_ptr<ShmArena>> exchange_arenas() const;

 private:
  friend class ShmHandshake;
  friend class ShmEngine;
  ShmChannel() = default;

  // Building an operation (shm_channel.cpp).
  std::shared_ptr<ShmOp> new_op(const char* name, uint32_t kind, int64_t bytes, at::ScalarType dtype, ReduceOp op,
                                std::vector<at::Tensor> keep);
  shm_plan::StageSpec stage_spec(bool gather, shm_plan::Geometry geo) const;
  std::shared_ptr<ShmOp> issue(std::shared_ptr<ShmOp> op);

  // Moving operations (shm_progress.cpp). The *_locked calls need the engine's lock.
  bool progress_locked();  // true if anything moved
  bool pending_locked() const { return !pending_.empty(); }
  bool advance_locked(ShmOp& op, bool may_write);
  bool write_fragments_locked(ShmOp& op, shm_plan::Stage& st);
  void publish_locked(ShmOp& op, shm_plan::Stage& st, const shm_plan::Write& w);
  bool read_fragments_locked(ShmOp& op, shm_plan::Stage& st);
  bool fragments_ready_locked(const ShmOp& op, const shm_plan::Read& r);
  void consume_locked(const ShmOp& op, const shm_plan::Read& r);
  const char* fragment_data(int writer, uint64_t fragment, int64_t bytes) const;
  bool release_in_place_locked(shm_plan::Stage& st);
  int slot_of(uint64_t fragment) const { return static_cast<int>((fragment - 1) % static_cast<uint64_t>(nslots_)); }

  // Waiting and failing (shm_progress.cpp).
  bool progress_once(const ShmOp& op, bool* moved, std::string* mismatch);
  bool sleep_until_moved(const ShmOp& op, bool* done);
  void check_peers_or_fail(const ShmOp& op, std::chrono::steady_clock::duration waited);
  [[noreturn]] void fail(const ShmOp& op, const std::string& cause);
  std::string failure(const ShmOp& op, const std::string& cause) const;
  std::string blocking_peers(const ShmOp& op) const;
  std::string peer_problem() const;  // "" while every peer is alive and has not given up

  std::shared_ptr<ShmEngine> engine_;  // registered with it from creation to destruction
  std::string group_name_;
  int rank_ = 0, size_ = 0, global_rank_ = 0;
  std::chrono::milliseconds timeout_{0};
  std::vector<std::string> peer_names_;  // describe_peer(r), for messages
  std::vector<std::unique_ptr<ShmSegment>> segs_;  // by group rank; segs_[rank_] is ours
  int64_t slot_bytes_ = 0;
  int nslots_ = 0;
  std::vector<uint64_t> assigned_;  // per writer: fragments assigned to its ring so far
  uint64_t published_ = 0;          // fragments this rank has published
  std::vector<std::shared_ptr<ShmOp>> pending_;  // issue order
  std::unique_ptr<char[]> temp_;  // one slot of scratch for sums into an aliased output
  // [Note: exchange arena]: ours (null unless every member mapped every member's arena
  // and in-place fragments are on) and the peers' by group rank, read where a slot says so.
  std::shared_ptr<ShmArena> own_arena_;
  std::vector<std::shared_ptr<ShmArena>> arenas_;
  std::string broken_;            // set when a wait failed: later calls fail at once
  uint64_t ops_issued_ = 0;       // numbers the operations ([Note: checked slots] in shm_op.h)
  std::string mismatch_;          // the first checked slot that did not match
};

/// The channel of group `g`, registered with `engine`, with ring slots of `slot_bytes`
/// (every member must pass the same value), or nullptr when some member is on another
/// host, cannot map the others' segments, or the group has one rank (every member gets
/// the same answer). Collective over `g`: it exchanges segment names through the group's
/// store (shm_handshake.cpp). `direct`: publish fragments that lie in this process's
/// exchange arena in place (FSDP_SHM_DIRECT, on unless "0"); every member maps the others'
/// arenas regardless.
std::shared_ptr<ShmChannel> make_shm_channel(const GroupDesc& g, std::shared_ptr<ShmEngine> engine,
                                             int64_t slot_bytes, bool direct);

}  // namespace fsdp::comm::detail
