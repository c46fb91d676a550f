#include "fsdp/core/trace.h"

#include <chrono>
#include <fstream>
#include <sstream>
#include <sys/stat.h>

#include <c10/util/Exception.h>

namespace fsdp {

namespace {
int64_t wall_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}
std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}
}  // namespace

Tracer::Tracer(std::string dir, int rank) : dir_(std::move(dir)), rank_(rank) {}

void Tracer::set_device_clock(std::shared_ptr<DeviceClock> clock) {
  std::lock_guard<std::mutex> lock(mu_);
  clock_ = std::move(clock);
}

Tracer::Mark Tracer::begin(int device_tid) {
  if (!enabled()) return {};
  std::lock_guard<std::mutex> lock(mu_);
  Mark m;
  m.us = wall_us();
  m.seq = seq_++;
  if (clock_ && device_tid >= 0) {
    m.device_tid = device_tid;
    m.device_begin = clock_->mark(device_tid);
  }
  return m;
}

void Tracer::end_on_device(Mark& mark) {
  if (!mark.device_begin || mark.device_end) return;
  std::lock_guard<std::mutex> lock(mu_);
  mark.device_end = clock_->mark(mark.device_tid);
}

void Tracer::end(const std::string& name, int tid, Mark& mark, const char* transport) {
  if (!enabled() || !mark.open()) return;
  end_on_device(mark);
  std::lock_guard<std::mutex> lock(mu_);
  spans_.push_back(TraceSpan{name, tid, mark.us, wall_us(), mark.seq, seq_++, transport});
  if (mark.device_begin) pending_.push_back({spans_.size() - 1, mark.device_begin, mark.device_end});
  mark = Mark{};
}

void Tracer::resolve_device_times() const {
  // Reading an event waits for it: done here, when the trace is read, never while training.
  for (const DeviceEvents& d : pending_) {
    spans_[d.span].device_begin_us = clock_->time_us(d.begin);
    spans_[d.span].device_end_us = clock_->time_us(d.end);
  }
  pending_.clear();
}

std::vector<TraceSpan> Tracer::spans() const {
  std::lock_guard<std::mutex> lock(mu_);
  resolve_device_times();
  return spans_;
}

void Tracer::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  spans_.clear();
  pending_.clear();
}

std::string Tracer::flush() const {
  if (!enabled()) return "";
  ::mkdir(dir_.c_str(), 0755);  // one level; an existing directory is fine
  const std::string path = dir_ + "/trace_rank" + std::to_string(rank_) + ".json";
  static const char* kStreams[] = {"compute", "all_gather", "reduce", "phases", "checkpoint"};
  std::ostringstream os;
  os << "{\"traceEvents\":[\n";
  std::lock_guard<std::mutex> lock(mu_);
  resolve_device_times();
  const int device_tids = clock_ ? 2 : 1;  // device times: tids 10, 11, 12
  bool first = true;
  for (int d = 0; d < device_tids; ++d) {
    // Every host track; on the device the streams only (phases have no device times).
    for (int tid = 0; tid <= (d ? kReduce : kCheckpoint); ++tid) {
      os << (first ? "" : ",\n") << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << rank_
         << ",\"tid\":" << (10 * d + tid) << ",\"args\":{\"name\":\"" << (d ? "device: " : "") << kStreams[tid]
         << "\"}}";
      first = false;
    }
  }
  auto event = [&](const TraceSpan& s, int tid, int64_t begin, int64_t end) {
    os << ",\n{\"name\":\"" << json_escape(s.name) << "\",\"ph\":\"X\",\"pid\":" << rank_
       << ",\"tid\":" << tid << ",\"ts\":" << begin << ",\"dur\":" << (end - begin)
       << ",\"args\":{\"begin_seq\":" << s.begin_seq << ",\"end_seq\":" << s.end_seq;
    if (!s.transport.empty()) os << ",\"transport\":\"" << json_escape(s.transport) << "\"";
    os << "}}";
  };
  for (const auto& s : spans_) {
    event(s, s.tid, s.begin_us, s.end_us);
    if (s.device_begin_us >= 0) event(s, 10 + s.tid, s.device_begin_us, s.device_end_us);
  }
  os << "\n],\"displayTimeUnit\":\"ms\"}\n";
  std::ofstream f(path);
  TORCH_CHECK(f.good(), "fsdp: cannot write the trace file ", path, " (rank ", rank_,
              "); check that the trace directory exists and is writable");
  f << os.str();
  return path;
}

}  // namespace fsdp
