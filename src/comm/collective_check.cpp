// [Note: checked collectives] in collective_check.h.
#include "collective_check.h"

#include <chrono>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "divergence.h"
#include "flight_exchange.h"
#include "store_bytes.h"

namespace fsdp::comm::detail {

namespace {

std::string key_of(const ProcessGroup& g, uint64_t seq, int rank) {
  return "fsdp/check/" + g.name() + "/" + std::to_string(seq) + "/" + std::to_string(rank);
}

// Every other rank's record of collective `seq`, until each arrived or is known gone, or the
// group's timeout passed.
std::vector<RankRecords> collect(const ProcessGroup& g, const CallRecord& mine) {
  std::vector<RankRecords> ranks(g.size());
  for (int r = 0; r < g.size(); ++r) ranks[r].rank = r;
  ranks[g.rank()] = {g.rank(), true, {mine}};
  collect_from_ranks(
      g, g.size(), g.rank(), [&](int r) { return key_of(g, mine.seq, r); }, [&](int r) { return g.peer_gone(r); },
      std::chrono::steady_clock::now() + g.timeout(), std::chrono::microseconds(50),
      [&](int r, const std::string& text) {
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
  const std::string d = describe_divergence(g.name(), collect(g, mine));
  TORCH_CHECK(d.empty(), "fsdp: collective check (FSDP_CHECK_COLLECTIVES) on group '", g.name(), "', rank ",
              g.rank(), ": ", d);
}

}  // namespace fsdp::comm::detail
