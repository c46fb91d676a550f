// [Note: failure exchange] in flight_exchange.h.
#include "flight_exchange.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "divergence.h"
#include "flight_recorder.h"
#include "store_bytes.h"

namespace fsdp::comm::detail {

namespace {

using Clock = std::chrono::steady_clock;

// What the exchange thread found; shared with it, since a store that blocks keeps it past the
// failing rank's patience.
struct Exchange {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool published = false;
  std::string store_error;
  std::vector<RankRecords> ranks;
};

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

void publish_and_collect(const ProcessGroup& g, const std::string& prefix, const std::string& mine,
                         Clock::time_point deadline, const std::shared_ptr<Exchange>& x) {
  const auto& store = g.store();
  try {
    store->set(prefix + std::to_string(g.rank()), store_bytes(mine));
    {
      std::lock_guard<std::mutex> lock(x->mu);
      x->published = true;
    }
    std::vector<bool> settled(g.size(), false);
    settled[g.rank()] = true;
    for (int left = g.size() - 1; left > 0 && Clock::now() < deadline;) {
      for (int r = 0; r < g.size(); ++r) {
        if (settled[r]) continue;
        const std::string key = prefix + std::to_string(r);
        if (store->check({key})) {
          std::vector<CallRecord> records = decode_records(store_string(store->get(key)));
          std::lock_guard<std::mutex> lock(x->mu);
          x->ranks[r].answered = true;
          x->ranks[r].records = std::move(records);
        } else if (!g.peer_gone(r)) {
          continue;
        }
        settled[r] = true;
        --left;
      }
      if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(x->mu);
    x->store_error = e.what();
  }
  std::lock_guard<std::mutex> lock(x->mu);
  x->done = true;
  x->cv.notify_all();
}

}  // namespace

RecordExchange exchange_records(const ProcessGroup& g, const std::string& tag, std::chrono::milliseconds wait) {
  const std::vector<CallRecord> mine = g.flight_recorder().recent();
  auto x = std::make_shared<Exchange>();
  x->ranks.resize(g.size());
  for (int r = 0; r < g.size(); ++r) x->ranks[r].rank = r;
  x->ranks[g.rank()].answered = true;
  x->ranks[g.rank()].records = mine;
  const std::string prefix = "fsdp/flight/" + g.name() + "/" + tag + "/";
  const Clock::time_point deadline = Clock::now() + wait;
  std::thread(publish_and_collect, g, prefix, encode_records(mine), deadline, x).detach();

  std::unique_lock<std::mutex> lock(x->mu);
  // A little past the thread's own deadline: its last store read may be under way.
  x->cv.wait_until(lock, deadline + std::chrono::milliseconds(500), [&] { return x->done; });
  RecordExchange out;
  out.ranks = x->ranks;
  if (!x->published || !x->store_error.empty())
    out.store_error = x->store_error.empty() ? "no answer" : first_line(x->store_error);
  return out;
}

namespace {

std::string own_records_text(const std::vector<CallRecord>& mine) {
  if (mine.empty()) return "it issued no collective on the group";
  std::string s = "its last collectives: ";
  const size_t from = mine.size() > 3 ? mine.size() - 3 : 0;
  for (size_t i = from; i < mine.size(); ++i)
    s += (i > from ? "; " : "") + mine[i].describe() + ", " + to_string(mine[i].state);
  return s;
}

std::string describe_failure(const ProcessGroup& g) {
  const std::vector<CallRecord> mine = g.flight_recorder().recent();
  const std::string head = "collective record of group '" + g.name() + "' on rank " + std::to_string(g.rank()) + ": ";
  const RecordExchange x = exchange_records(g, "failure", kExchangeWait);
  if (!x.store_error.empty()) return head + "store unreachable (" + x.store_error + "); " + own_records_text(mine);
  const std::string d = describe_divergence(g.name(), x.ranks);
  if (!d.empty()) return head + d;
  return head + "every rank that answered agrees on the collectives it issued; " + own_records_text(mine);
}

std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->msg();
  return e.what();
}

}  // namespace

void fail_collective(const ProcessGroup& g, uint64_t seq, const std::exception& error) {
  FlightRecorder& recorder = g.flight_recorder();
  recorder.fail(seq);
  const std::string text = g.size() > 1 ? recorder.failure_text([&] { return describe_failure(g); }) : "";
  if (text.empty()) throw;
  TORCH_CHECK(false, message_of(error), "\n", text);
}

}  // namespace fsdp::comm::detail
