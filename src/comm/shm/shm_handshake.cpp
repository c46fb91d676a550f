// The set-up of a shared-memory channel: collective over the group, through its store
// ([Note: shared-memory transport] in shm_channel.cpp, "Set-up").
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/store_bytes.h"
#include "shm_arena.h"
#include "shm_channel.h"
#include "shm_engine.h"
#include "shm_segment.h"

namespace fsdp::comm::detail {

namespace {

constexpr int kMinSlots = 16;

// Hostname and kernel boot id: two ranks that print the same one share a kernel, and so
// /dev/shm (a hostname alone repeats across containers and machines).
std::string host_identity() {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '?';
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(host) + "/" + (boot.empty() ? "?" : boot);
}

}  // namespace

// One member's run of the set-up, phase by phase; every member runs the same phases in the
// same order. Keys live under "fsdp/shm/<group>/": "seg/<rank>" what a member published,
// "ok/<rank>" its verdict.
class ShmHandshake {
 public:
  ShmHandshake(const GroupDesc& g, std::shared_ptr<ShmEngine> engine, int64_t slot_bytes, bool direct)
      : g_(g), engine_(std::move(engine)), slot_bytes_(slot_bytes), direct_(direct), n_(g.size()), me_(g.rank()),
        nslots_(std::max(kMinSlots, 2 * (n_ - 1))), prefix_("fsdp/shm/" + g.name() + "/") {}

  std::shared_ptr<ShmChannel> run() {
    start_channel();
    publish_own();
    const bool ok = map_peers();
    bool all_arenas = false;
    const bool all_ok = agree(ok, &all_arenas);
    // Every member has mapped our segment or given up: the name is no longer needed.
    if (!name_.empty()) ::shm_unlink(name_.c_str());
    if (!all_ok) {
      if (me_ == 0 && !why_.empty()) {
        std::fprintf(stderr, "fsdp: group '%s' uses Gloo for all its collectives, not shared memory: %s\n",
                     g_.name().c_str(), why_.c_str());
      }
      return nullptr;
    }
    return adopt(all_arenas);
  }

 private:
  // The channel's fields that need no peer.
  void start_channel() {
    ch_.reset(new ShmChannel());
    ch_->group_name_ = g_.name();
    ch_->rank_ = me_;
    ch_->size_ = n_;
    ch_->global_rank_ = g_.global_rank();
    ch_->timeout_ = g_.timeout();
    ch_->slot_bytes_ = slot_bytes_;
    ch_->nslots_ = nslots_;
    ch_->assigned_.assign(static_cast<size_t>(n_), 0);
    ch_->segs_.resize(static_cast<size_t>(n_));
    ch_->arenas_.resize(static_cast<size_t>(n_));
    for (int p = 0; p < n_; ++p) ch_->peer_names_.push_back(g_.describe_peer(p));
  }

  // Creates our segment (and, for in-place fragments, finds our exchange arena) and
  // publishes both: "ok <host> <segment> <nonce> <pid> <arena fd> <arena nonce>", with
  // "- - -" for no arena, or "no <host>" when the segment could not be made.
  void publish_own() {
    std::random_device rd;
    nonce_ = (uint64_t(rd()) << 32) ^ rd();
    ch_->segs_[me_] = create_segment(nslots_, slot_bytes_, nonce_, &name_, &why_);
    if (direct_) {
      std::lock_guard<std::mutex> lock(engine_->mutex());
      arena_ = engine_->own_arena_locked(&arena_why_);
    }
    host_ = host_identity();
    std::ostringstream mine;
    if (ch_->segs_[me_]) {
      mine << "ok " << host_ << " " << name_ << " " << nonce_ << " ";
      if (arena_) {
        mine << ::getpid() << " " << arena_->fd() << " " << arena_->nonce();
      } else {
        mine << "- - -";
      }
    } else {
      mine << "no " << host_;
    }
    g_.store()->set(prefix_ + "seg/" + std::to_string(me_), store_bytes(mine.str()));
  }

  // Maps every peer's segment, and its arena where it published one; false (and why_) at
  // the first peer on another host or whose segment does not map.
  bool map_peers() {
    bool ok = ch_->segs_[me_] != nullptr;
    for (int p = 0; p < n_ && ok; ++p) {
      if (p == me_) continue;
      std::istringstream is(store_string(g_.store()->get(prefix_ + "seg/" + std::to_string(p))));
      std::string status, their_host, their_name, apid, afd, anonce;
      uint64_t their_nonce = 0;
      is >> status >> their_host >> their_name >> their_nonce >> apid >> afd >> anonce;
      if (status != "ok" || their_host != host_) {
        ok = false;  // another host, or the peer could not create its segment
        break;
      }
      ch_->segs_[p] = open_segment(their_name, their_nonce, nslots_, slot_bytes_, &why_);
      ok = ch_->segs_[p] != nullptr;
      if (ok && apid != "-" && arena_why_.empty()) {
        std::lock_guard<std::mutex> lock(engine_->mutex());
        ch_->arenas_[p] = engine_->peer_arena_locked(std::stoi(apid), std::stoi(afd), std::stoull(anonce), &arena_why_);
      }
    }
    return ok;
  }

  // Publishes our verdict, segments mapped ("1") and every published arena mapped too
  // ("1 1"), and reads everyone's: true when every member mapped every segment,
  // `all_arenas` when every member mapped every arena too.
  bool agree(bool ok, bool* all_arenas) {
    const bool arenas_ok = ok && arena_why_.empty();
    g_.store()->set(prefix_ + "ok/" + std::to_string(me_), store_bytes(ok ? (arenas_ok ? "1 1" : "1 0") : "0"));
    bool all_ok = true;
    *all_arenas = true;
    for (int p = 0; p < n_; ++p) {
      const std::string v = store_string(g_.store()->get(prefix_ + "ok/" + std::to_string(p)));
      all_ok &= v.rfind("1", 0) == 0;
      *all_arenas &= v == "1 1";
    }
    return all_ok;
  }

  // The channel every member agreed on, registered with the engine. In-place fragments only
  // where every member can read every arena: otherwise the rings.
  std::shared_ptr<ShmChannel> adopt(bool all_arenas) {
    ch_->temp_.reset(new char[static_cast<size_t>(slot_bytes_)]);
    if (all_arenas) {
      ch_->own_arena_ = std::move(arena_);
    } else {
      ch_->arenas_.assign(static_cast<size_t>(n_), nullptr);
      if (me_ == 0 && direct_) {
        std::fprintf(stderr, "fsdp: group '%s' copies through its shared-memory rings only: %s\n", g_.name().c_str(),
                     arena_why_.empty() ? "a peer could not map an exchange arena" : arena_why_.c_str());
      }
    }
    std::lock_guard<std::mutex> lock(engine_->mutex());
    engine_->add_locked(ch_.get());
    ch_->engine_ = std::move(engine_);
    return std::move(ch_);
  }

  const GroupDesc& g_;
  std::shared_ptr<ShmEngine> engine_;
  const int64_t slot_bytes_;
  const bool direct_;
  const int n_, me_, nslots_;
  const std::string prefix_;
  uint64_t nonce_ = 0;
  std::shared_ptr<ShmChannel> ch_;
  std::string name_, why_, arena_why_;  // our segment's name; why set-up failed; why arenas did
  std::string host_;
  std::shared_ptr<ShmArena> arena_;  // ours, when in-place fragments are on
};

std::shared_ptr<ShmChannel> make_shm_channel(const GroupDesc& g, std::shared_ptr<ShmEngine> engine,
                                             int64_t slot_bytes, bool direct) {
  TORCH_INTERNAL_ASSERT(engine != nullptr && slot_bytes > 0);
  if (g.size() == 1) return nullptr;
  return ShmHandshake(g, std::move(engine), slot_bytes, direct).run();
}

}  // namespace fsdp::comm::detail
