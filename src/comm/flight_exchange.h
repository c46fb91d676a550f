#pragma once
// Internal to src/comm: what a rank does when one of its collectives fails
// ([Note: flight recorder] in flight_recorder.h).
//
// [Note: failure exchange]
// The failing rank publishes the records of every group it belongs to (a divergence on one
// group, say the all-gathers, often shows as a hang on another, the reductions) through the
// job's store under a key of its own for this exchange, then collects the other ranks' for a
// bounded time: until every rank of the world answered or is known gone, at most
// kExchangeWait. The peers fail too (at their own timeout, or at once when the failing rank
// leaves), so they publish within about the same time. The store itself may be gone (its
// host rank died, or the link is cut): every store call runs on a thread of its own that the
// failing rank waits for only so long, and the rank then reports "store unreachable" with
// its own last records. World rank 0, which hosts the store, leaves the exchange only when every
// rank that answered has read the others' records too, so that it does not take the store down
// under a peer still reading. A process takes part in one failure exchange per world: later failures
// (other handles of the same step, other groups) repeat its text.
#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "divergence.h"
#include "fsdp/comm/process_group.h"

namespace fsdp::comm::detail {

/// How long a failing rank waits for its peers' records.
constexpr std::chrono::milliseconds kExchangeWait{3000};

/// What one rank published: its records per group name, with its rank in each.
struct RankGroups {
  std::map<std::string, std::pair<int, std::vector<CallRecord>>> groups;
};

struct WorldExchange {
  std::vector<std::optional<RankGroups>> ranks;  ///< by world rank; nullopt: did not answer
  std::vector<GroupRecorder> mine;               ///< this rank's groups, in creation order
  std::string store_error;                       ///< non-empty: this rank could not publish
};

/// Reads `key_of(r)` from `g`'s store for every rank r != `me` of `n`, handing each text to
/// `on_found` as it appears, until every rank answered or is `gone`, or `deadline` passed.
/// Rounds are `pause` apart, doubling up to 20 ms. Shared by the failure exchange and the
/// checked mode; only the store carries it.
void collect_from_ranks(const ProcessGroup& g, int n, int me, const std::function<std::string(int)>& key_of,
                        const std::function<bool(int)>& gone, std::chrono::steady_clock::time_point deadline,
                        std::chrono::microseconds pause,
                        const std::function<void(int, const std::string&)>& on_found);

/// Publishes this rank's records of every group of `g`'s world under `tag` (a key of its own
/// for each exchange) and collects the other ranks' until each answered or is known gone, at
/// most `wait`. Only the store carries it, never a transport (which may be what failed).
WorldExchange exchange_records(const ProcessGroup& g, const std::string& tag, std::chrono::milliseconds wait);

/// The first divergence on each of this rank's groups that has one ([Note: first divergence]),
/// as "on group 'world/sub1': ..." lines: `first_group`'s first, divergences of content before
/// ranks that only did not answer (left out when `silent_too` is false). Empty when the
/// answers agree everywhere.
std::vector<std::string> describe_groups(const WorldExchange& x, const std::string& first_group,
                                         bool silent_too = true);

/// Marks collective `seq` of `g` failed, exchanges records (once per world) and throws the
/// original error with the divergence appended. Call it inside the catch block of `error`:
/// on a group of one rank it rethrows that exception unchanged.
[[noreturn]] void fail_collective(const ProcessGroup& g, uint64_t seq, const std::exception& error);

}  // namespace fsdp::comm::detail
