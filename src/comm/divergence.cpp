// [Note: first divergence] in divergence.h.
#include "divergence.h"

#include <algorithm>
#include <map>
#include <optional>

#include <c10/core/ScalarType.h>

#include "number_text.h"

namespace fsdp::comm::detail {

std::string name_ranks(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

namespace {

const CallRecord* find_seq(const RankRecords& r, uint64_t seq) {
  for (const CallRecord& c : r.records)
    if (c.seq == seq) return &c;
  return nullptr;
}

uint64_t last_seq(const RankRecords& r) { return r.records.empty() ? 0 : r.records.back().seq; }

// Ranks whose records at one sequence number are the same call, in rank order.
struct Agreement {
  const CallRecord* call;
  std::vector<int> ranks;
};

std::vector<Agreement> group_calls(const std::vector<std::pair<int, const CallRecord*>>& at) {
  std::vector<Agreement> groups;
  for (const auto& [rank, call] : at) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Agreement& g) { return g.call->same_call(*call); });
    if (it == groups.end()) groups.push_back({call, {rank}});
    else it->ranks.push_back(rank);
  }
  // The smallest party first: usually the rank that took another path.
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Agreement& a, const Agreement& b) { return a.ranks.size() < b.ranks.size(); });
  return groups;
}

std::string is_are(const std::vector<int>& ranks) { return ranks.size() == 1 ? " is at " : " are at "; }

// Same op and label on every rank, so only the size or the dtype differs.
std::string describe_size_mismatch(const std::vector<Agreement>& groups) {
  const CallRecord& first = *groups.front().call;
  CallRecord plain = first;
  plain.site.clear();
  std::string s = "ranks disagree at " + plain.describe() + ": ";
  const bool dtype_differs = std::any_of(groups.begin(), groups.end(),
                                         [&](const Agreement& g) { return g.call->dtype != first.dtype; });
  // "the others" only for a minority against one majority; otherwise every party by name.
  const bool minority = groups.size() == 2 && groups[0].ranks.size() < groups[1].ranks.size();
  for (size_t i = 0; i < groups.size(); ++i) {
    const CallRecord& c = *groups[i].call;
    const std::string what = dtype_differs ? std::string(c10::toString(c.dtype)) : with_thousands(c.numel);
    const std::string has = groups[i].ranks.size() == 1 ? " has " : " have ";
    if (i == 0) s += name_ranks(groups[i].ranks) + has + what + (dtype_differs ? "" : " elements");
    else if (minority) s += ", the others " + what;
    else s += ", " + name_ranks(groups[i].ranks) + has + what;
  }
  if (!first.site.empty()) s += " (at " + first.site + ")";
  return s;
}

std::string describe_different_calls(const std::vector<Agreement>& groups) {
  std::string s;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (i == 1) s += " while ";
    else if (i > 1) s += "; ";
    s += name_ranks(groups[i].ranks) + is_are(groups[i].ranks) + groups[i].call->describe();
  }
  return s;
}

std::optional<std::string> describe_disagreement(const std::vector<Agreement>& groups) {
  if (groups.size() < 2) return std::nullopt;
  const CallRecord& a = *groups.front().call;
  const bool same_label = std::all_of(groups.begin(), groups.end(), [&](const Agreement& g) {
    return g.call->op == a.op && g.call->phase == a.phase && g.call->subject == a.subject;
  });
  return same_label ? describe_size_mismatch(groups) : describe_different_calls(groups);
}

// Some ranks issued `seq` and wait in it; the others have not issued it.
std::string describe_missing(const std::string& group, uint64_t seq, const std::vector<Agreement>& waiting,
                             const std::vector<const RankRecords*>& behind) {
  std::string s = describe_different_calls(waiting);
  std::vector<int> ranks;
  for (const RankRecords* r : behind) ranks.push_back(r->rank);
  s += " while " + name_ranks(ranks) + (ranks.size() == 1 ? " has" : " have") + " not issued #" +
       std::to_string(seq) + " on group '" + group + "'";
  for (const RankRecords* r : behind) {
    if (r->records.empty()) {
      s += "; rank " + std::to_string(r->rank) + " issued nothing on it yet";
      continue;
    }
    const CallRecord& last = r->records.back();
    s += "; rank " + std::to_string(r->rank) + "'s last is " + last.describe() + ", " + to_string(last.state);
  }
  return s;
}

}  // namespace

std::string describe_divergence(const std::string& group, const std::vector<RankRecords>& ranks) {
  return find_divergence(group, ranks).text;
}

Divergence find_divergence(const std::string& group, const std::vector<RankRecords>& ranks) {
  std::vector<const RankRecords*> answered;
  std::vector<int> silent;
  for (const RankRecords& r : ranks) {
    if (r.answered) answered.push_back(&r);
    else silent.push_back(r.rank);
  }
  // Compare only where every answering rank still holds its records (the rings are bounded).
  uint64_t lo = 1, hi = 0;
  for (const RankRecords* r : answered) {
    if (!r->records.empty()) lo = std::max(lo, r->records.front().seq);
    hi = std::max(hi, last_seq(*r));
  }
  for (uint64_t seq = lo; seq <= hi; ++seq) {
    std::vector<std::pair<int, const CallRecord*>> at;
    std::vector<const RankRecords*> behind;
    for (const RankRecords* r : answered) {
      if (const CallRecord* c = find_seq(*r, seq)) at.emplace_back(r->rank, c);
      else if (last_seq(*r) < seq) behind.push_back(r);
    }
    const std::vector<Agreement> groups = group_calls(at);
    if (auto d = describe_disagreement(groups)) return {DivergenceKind::kContent, *d};
    const bool stuck_here = std::any_of(at.begin(), at.end(),
                                        [](const auto& p) { return p.second->state != RecordState::kCompleted; });
    if (!behind.empty() && stuck_here) return {DivergenceKind::kBehind, describe_missing(group, seq, groups, behind)};
  }
  if (silent.empty()) return {};
  std::string s = name_ranks(silent) + " did" +
                  " not answer: not in a collective of group '" + group + "' (stuck elsewhere, or gone)";
  for (const RankRecords* r : answered) {
    for (const CallRecord& c : r->records) {
      if (c.state == RecordState::kCompleted) continue;
      std::vector<int> waiting;
      for (const RankRecords* o : answered) waiting.push_back(o->rank);
      return {DivergenceKind::kSilent, s + ", while " + name_ranks(waiting) +
                                          (waiting.size() == 1 ? " waits" : " wait") + " at " + c.describe()};
    }
  }
  return {DivergenceKind::kSilent, s};
}

}  // namespace fsdp::comm::detail
