#pragma once
// Internal to src/state: what the ranks of a checkpoint save tell each other, through the
// group's store instead of its transports.
//
// [Note: checkpoint agreement through the store]
// A save's ranks agree three times: rank 0 has made `<dir>.tmp` (and every rank sees it,
// [Note: checkpoint directories are shared]); every rank has written and fsync'd its file
// (its part of the metadata, or its error); rank 0 has written the metadata (or why not).
// An asynchronous save does this on a writer thread while the training thread issues the
// step's collectives on the same groups: a collective from the writer would interleave with
// them in a different order on each rank and pair one rank's checkpoint message with
// another's gradient. The store is a channel of its own, keyed by name, so the writer's
// messages cannot meet the training's; the blocking save uses the same procedure, so both
// write the same bytes by construction.
// Keys are `fsdp/ckpt/<group>/<save>/<what>/<rank>`: <save> counts the saves of that group
// in this process, which every rank calls in the same order. Waits poll the store and end
// early when a peer on this host has exited; otherwise after the group's timeout, with an
// error naming the ranks that did not answer and where they ran.

#include <string>
#include <vector>

#include "fsdp/comm/process_group.h"

namespace fsdp::state {

class StoreAgreement {
 public:
  /// The next save's keys on `group` (every rank constructs them in the same order).
  /// `what` names the operation in errors ("save_checkpoint").
  StoreAgreement(comm::ProcessGroup group, std::string what);

  int rank() const { return group_.rank(); }
  int size() const { return group_.size(); }
  const comm::ProcessGroup& group() const { return group_; }

  /// Publishes this rank's `value` of `key`.
  void post(const std::string& key, const std::string& value) const;
  /// Every rank's value of `key`, by rank (this rank's must have been posted).
  std::vector<std::string> gather(const std::string& key) const;
  /// `root`'s value of `key` (root itself gets what it posted).
  std::string from(int root, const std::string& key) const;

 private:
  std::string key_of(const std::string& key, int rank) const;
  [[noreturn]] void fail_waiting(const std::string& key, const std::vector<int>& missing) const;

  comm::ProcessGroup group_;
  std::string what_;
  std::string prefix_;
};

}  // namespace fsdp::state
