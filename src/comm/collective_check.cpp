// [Note: checked collectives] in collective_check.h.
#include "collective_check.h"

#include <chrono>
#include <map>
#include <optional>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "divergence.h"
#include "flight_exchange.h"
#include "store_bytes.h"

namespace fsdp::comm::detail {

namespace {

// [Note: waits across groups] in collective_check.h.
constexpr std::chrono::milliseconds kAnnounceWaitAfter{100};
constexpr std::chrono::milliseconds kWaitCycleHolds{1000};

using Clock = std::chrono::steady_clock;

std::string key_of(const ProcessGroup& g, uint64_t seq, int rank) {
  return "fsdp/check/" + g.name() + "/" + std::to_string(seq) + "/" + std::to_string(rank);
}

std::string waiting_key(int world_rank) { return "fsdp/check/waiting/" + std::to_string(world_rank); }

// Where a rank waits: the group's name on the first line, then its record there.
struct Waiting {
  std::string group;
  CallRecord record;
};

std::string encode_waiting(const std::string& group, const CallRecord& r) {
  return group + "\n" + encode_records({r});
}

std::optional<Waiting> decode_waiting(const std::string& text) {
  const size_t eol = text.find('\n');
  if (eol == std::string::npos) return std::nullopt;
  auto records = decode_records(text.substr(eol + 1));
  if (records.size() != 1) return std::nullopt;
  return Waiting{text.substr(0, eol), std::move(records.front())};
}

// The number of this process's last collective on group `name` of `g`'s world (0: none yet);
// nullopt when this process is not in that group.
std::optional<uint64_t> last_issued(const ProcessGroup& g, const std::string& name) {
  for (const auto& gr : live_recorders(g.store().get())) {
    if (gr.group != name) continue;
    const auto rec = gr.recorder.lock();
    const auto records = rec ? rec->recent() : std::vector<CallRecord>{};
    return records.empty() ? 0 : records.back().seq;
  }
  return std::nullopt;
}

// One rank's wait at the check of `mine` on `g`: announces where it waits once it has waited
// a while, and finds a peer that waits for it on another group.
class WaitWatch {
 public:
  WaitWatch(const ProcessGroup& g, const CallRecord& mine) : g_(g), mine_(mine), start_(Clock::now()) {}

  /// Every rank arrived: this rank no longer waits here. A rank that fails leaves its key, so
  /// that a peer waiting for it still finds where it stopped.
  void withdraw() {
    if (announced_) g_.store()->deleteKey(waiting_key(g_.global_rank()));
  }

  /// True when group rank `r` has waited for this rank, on another group, for kWaitCycleHolds.
  bool waits_for_me(int r) {
    if (Clock::now() - start_ < kAnnounceWaitAfter) return false;
    announce();
    const auto peer = waiting_of(g_.global_ranks().at(r));
    auto& seen = seen_[r];
    const auto mine_there = peer ? last_issued(g_, peer->group) : std::nullopt;
    if (!peer || peer->group == g_.name() || !mine_there || *mine_there >= peer->record.seq) {
      seen.reset();
      return false;
    }
    if (!seen || seen->first.group != peer->group || seen->first.record.seq != peer->record.seq)
      seen = std::make_pair(*peer, Clock::now());
    if (Clock::now() - seen->second < kWaitCycleHolds) return false;
    cycle_ = std::make_pair(r, *peer);
    return true;
  }

  /// "rank 1 is at all_gather #7 (...) on group 'world/sub0' while rank 0 is at all_reduce #2
  /// (...) on group 'world', which rank 1 has not issued: each waits for the other" (world
  /// ranks: the two groups number their members apart); "" when no peer waits for this rank.
  std::string describe() const {
    if (!cycle_) return "";
    const int me = g_.global_rank(), peer = g_.global_ranks().at(cycle_->first);
    const Waiting& w = cycle_->second;
    return "rank " + std::to_string(me) + " is at " + mine_.describe() + " on group '" + g_.name() +
           "' while rank " + std::to_string(peer) + " is at " + w.record.describe() + " on group '" + w.group +
           "', which rank " + std::to_string(me) + " has not issued: each waits for the other";
  }

 private:
  void announce() {
    if (announced_) return;
    g_.store()->set(waiting_key(g_.global_rank()), store_bytes(encode_waiting(g_.name(), mine_)));
    announced_ = true;
  }
  std::optional<Waiting> waiting_of(int world_rank) const {
    const std::string key = waiting_key(world_rank);
    if (!g_.store()->check({key})) return std::nullopt;
    return decode_waiting(store_string(g_.store()->get(key)));
  }

  const ProcessGroup& g_;
  const CallRecord& mine_;
  const Clock::time_point start_;
  bool announced_ = false;
  std::map<int, std::optional<std::pair<Waiting, Clock::time_point>>> seen_;
  std::optional<std::pair<int, Waiting>> cycle_;
};

// Every other rank's record of collective `seq`, until each arrived or is known gone, or the
// group's timeout passed, or a rank is found waiting for this one on another group.
std::vector<RankRecords> collect(const ProcessGroup& g, const CallRecord& mine, WaitWatch& watch) {
  std::vector<RankRecords> ranks(g.size());
  for (int r = 0; r < g.size(); ++r) ranks[r].rank = r;
  ranks[g.rank()] = {g.rank(), true, {mine}};
  collect_from_ranks(
      g, g.size(), g.rank(), [&](int r) { return key_of(g, mine.seq, r); },
      [&](int r) { return g.peer_gone(r) || watch.waits_for_me(r); }, Clock::now() + g.timeout(),
      std::chrono::microseconds(50), [&](int r, const std::string& text) {
        ranks[r].answered = true;
        ranks[r].records = decode_records(text);
      });
  return ranks;
}

}  // namespace

void check_before_issue(const ProcessGroup& g, const CallRecord& mine) {
  const auto& store = g.store();
  store->set(key_of(g, mine.seq, g.rank()), store_bytes(encode_records({mine})));
  if (mine.seq > 2) store->deleteKey(key_of(g, mine.seq - 2, g.rank()));
  WaitWatch watch(g, mine);
  const std::vector<RankRecords> ranks = collect(g, mine, watch);
  const std::string cycle = watch.describe();
  const std::string d = cycle.empty() ? describe_divergence(g.name(), ranks) : cycle;
  TORCH_CHECK(d.empty(), "fsdp: collective check (FSDP_CHECK_COLLECTIVES) on group '", g.name(), "', rank ",
              g.rank(), ": ", d);
  watch.withdraw();
}

}  // namespace fsdp::comm::detail
