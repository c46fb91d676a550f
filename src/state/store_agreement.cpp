// See [Note: checkpoint agreement through the store] in store_agreement.h.
#include "store_agreement.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/flight_exchange.h"
#include "comm/store_bytes.h"

namespace fsdp::state {

namespace {

// The number of saves this process has begun on each group.
int64_t next_save_of(const std::string& group) {
  static std::mutex mu;
  static std::map<std::string, int64_t> count;
  std::lock_guard<std::mutex> lock(mu);
  return count[group]++;
}

}  // namespace

StoreAgreement::StoreAgreement(comm::ProcessGroup group, std::string what)
    : group_(std::move(group)), what_(std::move(what)) {
  const std::string name = group_.name() + "@" + std::to_string(group_.global_ranks().front());
  prefix_ = "fsdp/ckpt/" + name + "/" + std::to_string(next_save_of(name)) + "/";
}

std::string StoreAgreement::key_of(const std::string& key, int rank) const {
  return prefix_ + key + "/" + std::to_string(rank);
}

void StoreAgreement::post(const std::string& key, const std::string& value) const {
  group_.store()->set(key_of(key, rank()), comm::detail::store_bytes(value));
}

std::vector<std::string> StoreAgreement::gather(const std::string& key) const {
  std::vector<std::string> values(static_cast<size_t>(size()));
  std::vector<bool> answered(static_cast<size_t>(size()), false);
  answered[size_t(rank())] = true;
  values[size_t(rank())] = comm::detail::store_string(group_.store()->get(key_of(key, rank())));
  const auto deadline = std::chrono::steady_clock::now() + group_.timeout();
  comm::detail::collect_from_ranks(
      group_, size(), rank(), [&](int r) { return key_of(key, r); }, [&](int r) { return group_.peer_gone(r); },
      deadline, std::chrono::microseconds(200), [&](int r, const std::string& text) {
        values[size_t(r)] = text;
        answered[size_t(r)] = true;
      });
  std::vector<int> missing;
  for (int r = 0; r < size(); ++r)
    if (!answered[size_t(r)]) missing.push_back(r);
  if (!missing.empty()) fail_waiting(key, missing);
  return values;
}

std::string StoreAgreement::from(int root, const std::string& key) const {
  const std::string k = key_of(key, root);
  const auto deadline = std::chrono::steady_clock::now() + group_.timeout();
  auto pause = std::chrono::microseconds(200);
  const auto& store = group_.store();
  while (!store->check({k})) {
    if (group_.peer_gone(root) || std::chrono::steady_clock::now() >= deadline) fail_waiting(key, {root});
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
  return comm::detail::store_string(store->get(k));
}

void StoreAgreement::fail_waiting(const std::string& key, const std::vector<int>& missing) const {
  std::ostringstream os;
  os << "fsdp: " << what_ << " on rank " << rank() << ": ";
  for (size_t i = 0; i < missing.size(); ++i)
    os << (i ? ", " : "") << group_.describe_peer(missing[i]) << (group_.peer_gone(missing[i]) ? " (exited)" : "");
  os << " did not report '" << key << "' within "
     << std::chrono::duration_cast<std::chrono::seconds>(group_.timeout()).count()
     << " s (the group's timeout); nothing was renamed into place. " << group_.dead_peers_hint();
  TORCH_CHECK(false, os.str());
}

}  // namespace fsdp::state
