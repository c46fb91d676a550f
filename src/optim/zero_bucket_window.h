#pragma once
// Internal to src/optim: ZeroRedundancyOptimizer's per-bucket collectives in step()
// (stage 1's reductions, the all-gather of the updated parameters), issued in bucket
// order with at most `window` in flight (2 with overlap_communication: the next
// bucket's collective runs while the previous one's result is used).
#include <deque>
#include <utility>

#include "fsdp/comm/collectives.h"

namespace fsdp::optim::detail {

/// Issues one collective per bucket through `issue(b)` (which returns its handle),
/// keeping at most `window` in flight, and calls `done(b)` once bucket b's collective
/// completed, in bucket order.
template <typename Issue, typename Done>
void for_each_bucket(int num_buckets, int window, Issue issue, Done done) {
  std::deque<std::pair<int, comm::CommHandle>> in_flight;
  auto retire = [&] {
    in_flight.front().second.wait();
    done(in_flight.front().first);
    in_flight.pop_front();
  };
  for (int b = 0; b < num_buckets; ++b) {
    if (static_cast<int>(in_flight.size()) >= window) retire();
    in_flight.emplace_back(b, issue(b));
  }
  while (!in_flight.empty()) retire();
}

}  // namespace fsdp::optim::detail
