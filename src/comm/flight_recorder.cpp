// The per-group ring of recent collectives ([Note: flight recorder] in flight_recorder.h).
#include "flight_recorder.h"

#include <algorithm>
#include <sstream>

#include <c10/util/Exception.h>

#include "collective_call.h"

namespace fsdp::comm::detail {

const char* to_string(RecordState s) {
  switch (s) {
    case RecordState::kIssued: return "issued";
    case RecordState::kCompleted: return "completed";
    case RecordState::kFailed: return "failed";
  }
  return "?";
}

std::string CallRecord::describe() const {
  std::string s = op + " #" + std::to_string(seq) + " (";
  if (!subject.empty()) s += subject + ", ";
  s += comm::to_string(phase);
  s += ")";
  if (!site.empty()) s += " at " + site;
  return s;
}

bool CallRecord::same_call(const CallRecord& o) const {
  return op == o.op && dtype == o.dtype && numel == o.numel && phase == o.phase && subject == o.subject;
}

uint64_t FlightRecorder::record(const CollectiveCall& call) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t seq = next_seq_++;
  CallRecord& r = ring_[seq % kCapacity];
  r.seq = seq;
  r.op = to_string(call.op);
  r.dtype = call.dtype();
  r.numel = call.numel();
  r.phase = call.label.phase;
  r.subject = call.label.subject;
  sites_[seq % kCapacity] = {call.label.file, call.label.line};
  r.state = RecordState::kIssued;
  return seq;
}

void FlightRecorder::set_state(uint64_t seq, RecordState s) {
  std::lock_guard<std::mutex> lock(mu_);
  CallRecord& r = ring_[seq % kCapacity];
  if (r.seq == seq) r.state = s;  // else overwritten long ago: nothing left to mark
}

CallRecord FlightRecorder::at(uint64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t i = seq % kCapacity;
  TORCH_INTERNAL_ASSERT(ring_[i].seq == seq, "fsdp: flight record #", seq, " is gone");
  CallRecord r = ring_[i];
  r.site = describe_site(sites_[i].first, sites_[i].second);
  return r;
}

std::vector<CallRecord> FlightRecorder::recent() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CallRecord> out;
  for (size_t i = 0; i < kCapacity; ++i) {
    if (ring_[i].seq == 0) continue;
    out.push_back(ring_[i]);
    out.back().site = describe_site(sites_[i].first, sites_[i].second);
  }
  std::sort(out.begin(), out.end(), [](const CallRecord& a, const CallRecord& b) { return a.seq < b.seq; });
  return out;
}

namespace {

struct Registry {
  std::mutex mu;
  std::vector<GroupRecorder> entries;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_recorder(GroupRecorder entry) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.entries.erase(std::remove_if(r.entries.begin(), r.entries.end(),
                                 [](const GroupRecorder& e) { return e.recorder.expired(); }),
                  r.entries.end());
  r.entries.push_back(std::move(entry));
}

std::vector<GroupRecorder> live_recorders(const void* world) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<GroupRecorder> out;
  for (const GroupRecorder& e : r.entries)
    if (e.world == world && !e.recorder.expired()) out.push_back(e);
  return out;
}

namespace {

// Subjects and sites are the library's own strings; tabs and newlines would break a line.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\t', ' ');
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

}  // namespace

std::string encode_records(const std::vector<CallRecord>& records) {
  std::ostringstream os;
  for (const CallRecord& r : records) {
    os << r.seq << '\t' << r.op << '\t' << static_cast<int>(r.dtype) << '\t' << r.numel << '\t'
       << static_cast<int>(r.phase) << '\t' << static_cast<int>(r.state) << '\t' << one_line(r.site) << '\t'
       << one_line(r.subject) << '\n';
  }
  return os.str();
}

std::vector<CallRecord> decode_records(const std::string& text) {
  std::vector<CallRecord> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::vector<std::string> f;
    std::istringstream fields(line);
    std::string field;
    while (std::getline(fields, field, '\t')) f.push_back(field);
    if (f.size() == 7) f.emplace_back();  // an empty subject
    if (f.size() != 8) continue;          // not ours: skip rather than guess
    CallRecord r;
    r.seq = std::stoull(f[0]);
    r.op = f[1];
    r.dtype = static_cast<at::ScalarType>(std::stoi(f[2]));
    r.numel = std::stoll(f[3]);
    r.phase = static_cast<Phase>(std::stoi(f[4]));
    r.state = static_cast<RecordState>(std::stoi(f[5]));
    r.site = f[6];
    r.subject = f[7];
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace fsdp::comm::detail
