#pragma once
// Internal to src/comm: what the ranks' flight records say about a failed collective
// ([Note: flight recorder] in flight_recorder.h), in words.
//
// [Note: first divergence]
// Ranks agree when, on one group, the collective with the same sequence number has the same
// op, dtype, size and label on every rank. Ranks legitimately differ in how far they got
// (prefetch, a rank that is faster), so a rank that has not issued a number yet is not a
// divergence by itself; it is one when the ranks that did issue it are stuck there. The
// description names the first sequence number at which the answering ranks disagree, and
// else the ranks that did not answer at all (dead, or stuck outside any collective of the
// group).
#include <string>
#include <vector>

#include "flight_recorder.h"

namespace fsdp::comm::detail {

struct RankRecords {
  int rank = 0;           ///< in the group
  bool answered = false;  ///< false: nothing arrived from it within the exchange's time
  std::vector<CallRecord> records;  ///< oldest first
};

enum class DivergenceKind {
  kNone,    ///< the answers agree
  kContent, ///< ranks issued different collectives at one sequence number
  kBehind,  ///< ranks wait in a collective that others have not issued
  kSilent,  ///< only: some ranks did not answer
};
struct Divergence {
  DivergenceKind kind = DivergenceKind::kNone;
  std::string text;
};
Divergence find_divergence(const std::string& group, const std::vector<RankRecords>& ranks);

/// The first divergence among `ranks` (every rank of group `group`, in rank order), e.g.
/// "rank 1 is at all_gather #57 (blocks.3, forward) while ranks 0, 2, 3 are at
/// reduce_scatter #57 (blocks.2, backward)"; "" when the answers agree.
std::string describe_divergence(const std::string& group, const std::vector<RankRecords>& ranks);

/// "rank 2", "ranks 0, 2, 3".
std::string name_ranks(const std::vector<int>& ranks);

}  // namespace fsdp::comm::detail
