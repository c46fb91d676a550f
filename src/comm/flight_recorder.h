#pragma once
// Internal to src/comm: the last collectives each process group issued, always on.
//
// [Note: flight recorder]
// A rank that waits at a collective its peers never issue can only time out; the timeout alone
// says nothing of why. So the choke point (collective_call.h) records every collective in a
// bounded ring per group: its sequence number on that group (1, 2, ... in issue order, the
// same number on every rank for the same collective when the ranks agree), op, dtype, element
// count, label (phase, unit path or bucket) and the line that made the label, and whether it
// completed. When a collective fails, the ranks compare the rings of all their groups
// (flight_exchange.h) and the error names the first place they disagree (divergence.h). Sub-groups have rings and
// counters of their own, so groups running ahead of each other never look like a divergence.
// One record costs a lock and a few stores (no allocation once a slot's subject string has
// grown to its size); docs/benchmarks.md has the measured cost per step.
#include <array>
#include <memory>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>

#include "fsdp/comm/call_label.h"

namespace fsdp::comm::detail {

struct CollectiveCall;

enum class RecordState : uint8_t { kIssued, kCompleted, kFailed };
const char* to_string(RecordState s);

struct CallRecord {
  uint64_t seq = 0;  ///< 1-based, per group; 0: an empty slot
  std::string op;    ///< "all_gather", ...
  at::ScalarType dtype = at::kByte;
  int64_t numel = 0;
  Phase phase = Phase::kUnlabelled;
  std::string subject;
  std::string site;  ///< "src/core/unit.cpp:120" (filled by recent() and decode_records)
  RecordState state = RecordState::kIssued;

  /// "all_gather #57 (blocks.3, forward) at src/core/unit.cpp:120".
  std::string describe() const;
  /// Same op, dtype, size and label: what every rank must agree on.
  bool same_call(const CallRecord& other) const;
};

class FlightRecorder {
 public:
  static constexpr size_t kCapacity = 64;

  /// Records `call` as issued; returns its sequence number on this group.
  uint64_t record(const CollectiveCall& call);
  void complete(uint64_t seq) { set_state(seq, RecordState::kCompleted); }
  void fail(uint64_t seq) { set_state(seq, RecordState::kFailed); }
  /// Record `seq` as it is now (site filled); requires a seq not yet overwritten.
  CallRecord at(uint64_t seq) const;
  /// The records still in the ring, oldest first.
  std::vector<CallRecord> recent() const;

 private:
  void set_state(uint64_t seq, RecordState s);

  mutable std::mutex mu_;
  std::array<CallRecord, kCapacity> ring_;
  // Where each slot's label was made; turned into text only when the ring is read.
  std::array<std::pair<const char*, int>, kCapacity> sites_{};
  uint64_t next_seq_ = 1;
};

/// A live group's recorder, as the failure exchange finds it: every group of a world is
/// compared, since a divergence on one group (the gathers) often shows as a hang on another
/// (the reductions).
struct GroupRecorder {
  std::string group;              ///< ProcessGroup::name()
  int group_rank = 0;
  std::vector<int> global_ranks;  ///< member i -> world rank
  const void* world = nullptr;    ///< the world's store: groups of another world are not ours
  std::weak_ptr<FlightRecorder> recorder;
};
void register_recorder(GroupRecorder entry);
/// The live groups of `world` in this process, in creation order.
std::vector<GroupRecorder> live_recorders(const void* world);

/// Records as text lines and back, for the exchange through the store.
std::string encode_records(const std::vector<CallRecord>& records);
std::vector<CallRecord> decode_records(const std::string& text);

}  // namespace fsdp::comm::detail
