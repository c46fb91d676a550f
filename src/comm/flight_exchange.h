#pragma once
// Internal to src/comm: what a rank does when one of its collectives fails
// ([Note: flight recorder] in flight_recorder.h).
//
// [Note: failure exchange]
// The failing rank publishes its group's records through the job's store under keys of this
// failure's own (group name and the group's failure number), then collects the other ranks'
// for a bounded time: until every rank answered or is known gone, at most kExchangeWait. The
// peers fail too (at their own timeout, or at once when the failing rank leaves), so they
// publish within about the same time. The store itself may be gone (its host rank died, or
// the link is cut): every store call is bounded, and the rank then reports "store
// unreachable" with its own last records. The first exchange on a group is the only one:
// later failures on it (other handles of the same step) repeat its text, so that every rank
// takes part in exactly one exchange per group.
#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include "divergence.h"
#include "fsdp/comm/process_group.h"

namespace fsdp::comm::detail {

/// How long a failing rank waits for its peers' records.
constexpr std::chrono::milliseconds kExchangeWait{3000};

struct RecordExchange {
  std::vector<RankRecords> ranks;  ///< every rank of the group; answered: its records arrived
  std::string store_error;         ///< non-empty: this rank could not publish its own
};
/// Publishes this rank's records of `g` under `tag` (a key of its own for each exchange) and
/// collects the others' until every rank answered or is known gone, at most `wait`. Only the
/// store carries it (never the group's transport, which may be what failed).
RecordExchange exchange_records(const ProcessGroup& g, const std::string& tag, std::chrono::milliseconds wait);

/// Marks collective `seq` of `g` failed, exchanges records (once per group) and throws the
/// original error with the first divergence appended. Call it inside the catch block of
/// `error`: on a group of one rank it rethrows that exception unchanged.
[[noreturn]] void fail_collective(const ProcessGroup& g, uint64_t seq, const std::exception& error);

}  // namespace fsdp::comm::detail
