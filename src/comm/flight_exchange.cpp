// [Note: failure exchange] in flight_exchange.h.
#include "flight_exchange.h"

#include <algorithm>
#include <cstdio>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "flight_recorder.h"
#include "store_bytes.h"

namespace fsdp::comm::detail {

namespace {

using Clock = std::chrono::steady_clock;

// A rank's groups as text: a "#\t<group>\t<rank in it>" line, then the group's records.
std::string encode_groups(const std::vector<GroupRecorder>& groups) {
  std::string out;
  for (const GroupRecorder& g : groups) {
    auto recorder = g.recorder.lock();
    if (!recorder) continue;
    out += "#\t" + g.group + "\t" + std::to_string(g.group_rank) + "\n" + encode_records(recorder->recent());
  }
  return out;
}

RankGroups decode_groups(const std::string& text) {
  RankGroups out;
  std::istringstream lines(text);
  std::string line, name, body;
  int rank = 0;
  auto flush = [&] {
    if (!name.empty()) out.groups[name] = {rank, decode_records(body)};
    body.clear();
  };
  while (std::getline(lines, line)) {
    if (line.rfind("#\t", 0) == 0) {
      flush();
      const size_t tab = line.find('\t', 2);
      name = line.substr(2, tab - 2);
      rank = tab == std::string::npos ? 0 : std::stoi(line.substr(tab + 1));
    } else {
      body += line + "\n";
    }
  }
  flush();
  return out;
}

// What the exchange thread found; shared with it, since a store that blocks keeps it past the
// failing rank's patience.
struct Exchange {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool published = false;
  std::string store_error;
  std::vector<std::optional<RankGroups>> ranks;
};

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// Whether world rank `w` is known gone: a member of `g` on this host whose process exited.
bool world_rank_gone(const ProcessGroup& g, int w) {
  const auto& members = g.global_ranks();
  const auto it = std::find(members.begin(), members.end(), w);
  return it != members.end() && g.peer_gone(static_cast<int>(it - members.begin()));
}

// World rank 0 hosts the store (unless the launcher's agent does) and takes it down when it
// exits, possibly before a peer read its records: every rank says it has read, and rank 0
// leaves only when each rank that answered said so too (or is gone, or the deadline passed).
// The other ranks do not wait: the last reader would find the store gone under it.
void stay_until_read(const ProcessGroup& world, const std::string& prefix, int me, Clock::time_point deadline,
                     Exchange& x) {
  world.store()->set(prefix + "read/" + std::to_string(me), store_bytes("1"));
  if (me != 0) return;
  std::vector<bool> answered(x.ranks.size());
  {
    std::lock_guard<std::mutex> lock(x.mu);
    for (size_t r = 0; r < x.ranks.size(); ++r) answered[r] = x.ranks[r].has_value();
  }
  collect_from_ranks(
      world, static_cast<int>(answered.size()), me, [&](int r) { return prefix + "read/" + std::to_string(r); },
      [&](int r) { return !answered[r] || world_rank_gone(world, r); }, deadline, std::chrono::milliseconds(5),
      [](int, const std::string&) {});
}

void publish_and_collect(ProcessGroup world, std::string prefix, std::string mine, int me, Clock::time_point deadline,
                         std::shared_ptr<Exchange> x) {
  try {
    world.store()->set(prefix + std::to_string(me), store_bytes(mine));
    {
      std::lock_guard<std::mutex> lock(x->mu);
      x->published = true;
    }
    collect_from_ranks(
        world, static_cast<int>(x->ranks.size()), me, [&](int r) { return prefix + std::to_string(r); },
        [&](int r) { return world_rank_gone(world, r); }, deadline, std::chrono::milliseconds(20),
        [&](int r, const std::string& text) {
          RankGroups groups = decode_groups(text);
          std::lock_guard<std::mutex> lock(x->mu);
          x->ranks[r] = std::move(groups);
        });
    stay_until_read(world, prefix, me, deadline, *x);
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(x->mu);
    x->store_error = e.what();
  }
  std::lock_guard<std::mutex> lock(x->mu);
  x->done = true;
  x->cv.notify_all();
}

// The ranks of group `gr` as they answered: by rank in the group.
std::vector<RankRecords> members_of(const WorldExchange& x, const GroupRecorder& gr) {
  std::vector<RankRecords> out;
  for (size_t i = 0; i < gr.global_ranks.size(); ++i) {
    RankRecords r;
    r.rank = static_cast<int>(i);
    const int w = gr.global_ranks[i];
    if (w < static_cast<int>(x.ranks.size()) && x.ranks[w]) {
      r.answered = true;
      const auto it = x.ranks[w]->groups.find(gr.group);
      if (it != x.ranks[w]->groups.end()) r.records = it->second.second;
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

void collect_from_ranks(const ProcessGroup& g, int n, int me, const std::function<std::string(int)>& key_of,
                        const std::function<bool(int)>& gone, Clock::time_point deadline, std::chrono::microseconds pause,
                        const std::function<void(int, const std::string&)>& on_found) {
  const auto& store = g.store();
  std::vector<bool> settled(n, false);
  settled[me] = true;
  for (int left = n - 1; left > 0 && Clock::now() < deadline;) {
    for (int r = 0; r < n; ++r) {
      if (settled[r]) continue;
      const std::string key = key_of(r);
      if (store->check({key})) on_found(r, store_string(store->get(key)));
      else if (!gone(r)) continue;
      settled[r] = true;
      --left;
    }
    if (left == 0) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

// c10d's store client logs a warning with a C++ backtrace when the store's host is gone; the
// exchange says so itself ("store unreachable"), so warnings stay held back while it runs,
// and after it while a store call of its thread may still be under way.
class HeldBackStoreWarnings {
 public:
  HeldBackStoreWarnings() : saved_(FLAGS_caffe2_log_level) { FLAGS_caffe2_log_level = std::max(saved_, kErrorLevel); }
  void restore() { FLAGS_caffe2_log_level = saved_; }

 private:
  static constexpr int kErrorLevel = 2;
  int saved_;
};

WorldExchange exchange_records(const ProcessGroup& g, const std::string& tag, std::chrono::milliseconds wait) {
  HeldBackStoreWarnings held_back;
  const void* world = g.store().get();
  WorldExchange out;
  out.mine = live_recorders(world);
  const int n = g.launch_env().world_size;
  const int me = g.global_rank();
  const std::string mine = encode_groups(out.mine);
  auto x = std::make_shared<Exchange>();
  x->ranks.resize(n);
  x->ranks[me] = decode_groups(mine);
  const Clock::time_point deadline = Clock::now() + wait;
  std::thread(publish_and_collect, g, "fsdp/flight/" + tag + "/", mine, me, deadline, x).detach();

  std::unique_lock<std::mutex> lock(x->mu);
  // A little past the thread's own deadline: its last store read may be under way.
  x->cv.wait_until(lock, deadline + std::chrono::milliseconds(500), [&] { return x->done; });
  out.ranks = x->ranks;
  if (x->done) held_back.restore();
  if (!x->published || !x->store_error.empty())
    out.store_error = x->store_error.empty() ? "no answer" : first_line(x->store_error);
  return out;
}

std::vector<std::string> describe_groups(const WorldExchange& x, const std::string& first_group, bool silent_too) {
  std::vector<GroupRecorder> order = x.mine;
  std::stable_partition(order.begin(), order.end(), [&](const GroupRecorder& g) { return g.group == first_group; });
  std::vector<std::string> content, silent;
  for (const GroupRecorder& gr : order) {
    const Divergence d = find_divergence(gr.group, members_of(x, gr));
    if (d.kind == DivergenceKind::kNone) continue;
    const std::string line = "on group '" + gr.group + "': " + d.text;
    (d.kind == DivergenceKind::kSilent ? silent : content).push_back(line);
  }
  if (!content.empty()) return content;
  if (silent_too && !silent.empty()) return {silent.front()};  // the same ranks are silent on every group
  return {};
}

namespace {

std::string own_records_text(const ProcessGroup& g) {
  const std::vector<CallRecord> mine = g.flight_recorder().recent();
  if (mine.empty()) return "it issued no collective on group '" + g.name() + "'";
  std::string s = "its last collectives on group '" + g.name() + "': ";
  const size_t from = mine.size() > 3 ? mine.size() - 3 : 0;
  for (size_t i = from; i < mine.size(); ++i)
    s += (i > from ? "; " : "") + mine[i].describe() + ", " + to_string(mine[i].state);
  return s;
}

std::string describe_failure(const ProcessGroup& g, const std::string& error) {
  // Said at once: a launcher that sees the job falling apart may stop this rank before the
  // exchange ends, and the cause must not be lost with it.
  std::fprintf(stderr, "%s\nfsdp: rank %d: comparing collective records with the other ranks (at most %lld ms)\n",
               first_line(error).c_str(), g.global_rank(), static_cast<long long>(kExchangeWait.count()));
  std::fflush(stderr);
  const std::string head = "collective record (rank " + std::to_string(g.global_rank()) + "): ";
  const WorldExchange x = exchange_records(g, "failure", kExchangeWait);
  if (!x.store_error.empty()) return head + "store unreachable (" + x.store_error + "); " + own_records_text(g);
  const std::vector<std::string> lines = describe_groups(x, g.name());
  if (lines.empty()) return head + "every rank that answered agrees on the collectives it issued; " + own_records_text(g);
  std::string s = head + lines.front();
  for (size_t i = 1; i < lines.size() && i < 3; ++i) s += "\n" + head + lines[i];
  return s;
}

std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->msg();
  return e.what();
}

struct Failures {
  std::mutex mu;  // held through the exchange: a second failure waits for its text
  std::map<const void*, std::string> text_by_world;
};

// One exchange per world ([Note: failure exchange]).
std::string failure_text(const ProcessGroup& g, const std::string& error) {
  static Failures f;
  std::lock_guard<std::mutex> lock(f.mu);
  auto it = f.text_by_world.find(g.store().get());
  if (it == f.text_by_world.end()) it = f.text_by_world.emplace(g.store().get(), describe_failure(g, error)).first;
  return it->second;
}

}  // namespace

void fail_collective(const ProcessGroup& g, uint64_t seq, const std::exception& error) {
  g.flight_recorder().fail(seq);
  if (g.size() < 2) throw;
  const std::string message = message_of(error);
  TORCH_CHECK(false, message, "\n", failure_text(g, message));
}

}  // namespace fsdp::comm::detail
