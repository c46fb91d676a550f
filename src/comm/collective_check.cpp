// [Note: checked collectives] in collective_check.h.
#include "collective_check.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "divergence.h"
#include "store_bytes.h"

namespace fsdp::comm::detail {

namespace {

std::string key_of(const ProcessGroup& g, uint64_t seq, int rank) {
  return "fsdp/check/" + g.name() + "/" + std::to_string(seq) + "/" + std::to_string(rank);
}

// Every other rank's record of collective `seq`, until each arrived or is known gone, or the
// group's timeout passed.
std::vector<RankRecords> collect(const ProcessGroup& g, const CallRecord& mine) {
  const auto& store = g.store();
  std::vector<RankRecords> ranks(g.size());
  std::vector<bool> settled(g.size(), false);
  for (int r = 0; r < g.size(); ++r) ranks[r].rank = r;
  ranks[g.rank()] = {g.rank(), true, {mine}};
  settled[g.rank()] = true;
  const auto deadline = std::chrono::steady_clock::now() + g.timeout();
  auto pause = std::chrono::microseconds(50);
  for (int left = g.size() - 1; left > 0 && std::chrono::steady_clock::now() < deadline;) {
    for (int r = 0; r < g.size(); ++r) {
      if (settled[r]) continue;
      const std::string key = key_of(g, mine.seq, r);
      if (store->check({key})) {
        ranks[r].answered = true;
        ranks[r].records = decode_records(store_string(store->get(key)));
      } else if (!g.peer_gone(r)) {
        continue;
      }
      settled[r] = true;
      --left;
    }
    if (left == 0) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
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
