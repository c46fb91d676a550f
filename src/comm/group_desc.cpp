// See [Note: group descriptor] in group_desc.h.
#include "group_desc.h"

#include <unistd.h>

#include <sstream>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "process_gone.h"

namespace fsdp::comm::detail {

std::string this_host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

GroupDesc::GroupDesc(Facts facts) : facts_(std::make_shared<Shared>()) {
  facts_->rank = facts.c10d ? facts.c10d->getRank() : 0;
  facts_->size = facts.c10d ? facts.c10d->getSize() : 0;
  facts_->facts = std::move(facts);
}

void GroupDesc::set_world_peers(std::shared_ptr<const std::vector<Peer>> peers) {
  facts_->world_peers = std::move(peers);
}

std::string GroupDesc::describe_peer(int r) const {
  const auto& ranks = global_ranks();
  if (r < 0 || r >= static_cast<int>(ranks.size())) return "rank ?";
  const int g = ranks[r];
  std::ostringstream os;
  os << "rank " << r;
  if (name() != "world") os << " (world rank " << g << ")";
  const auto& peers = world_peers();
  if (peers && g < static_cast<int>(peers->size())) {
    const Peer& p = (*peers)[g];
    os << " [pid " << p.pid << " on " << p.host << "]";
  }
  return os.str();
}

bool GroupDesc::peer_gone(int r) const {
  const auto& ranks = global_ranks();
  if (r < 0 || r >= static_cast<int>(ranks.size())) return false;
  const int g = ranks[r];
  const auto& peers = world_peers();
  if (!peers || g >= static_cast<int>(peers->size())) return false;
  const Peer& p = (*peers)[g];
  return p.host == this_host_name() && p.pid > 0 && process_gone(p.pid);
}

std::string GroupDesc::dead_peers_hint() const {
  const std::string me = this_host_name();
  const auto& peers = world_peers();
  std::ostringstream os;
  int dead = 0;
  for (int r = 0; r < static_cast<int>(global_ranks().size()); ++r) {
    const int g = global_ranks()[r];
    if (!peers || g >= static_cast<int>(peers->size())) continue;
    const Peer& p = (*peers)[g];
    if (p.host != me || p.pid <= 0) continue;
    if (process_gone(p.pid)) {
      os << (dead++ ? ", " : "") << describe_peer(r);
    }
  }
  if (dead == 0) return "";
  return "; gone: " + os.str();
}

}  // namespace fsdp::comm::detail
