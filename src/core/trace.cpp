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

Tracer::Mark Tracer::begin() {
  if (!enabled()) return {};
  std::lock_guard<std::mutex> lock(mu_);
  return Mark{wall_us(), seq_++};
}

void Tracer::end(const std::string& name, int tid, Mark& mark, const char* transport) {
  if (!enabled() || !mark.open()) return;
  std::lock_guard<std::mutex> lock(mu_);
  spans_.push_back(TraceSpan{name, tid, mark.us, wall_us(), mark.seq, seq_++, transport});
  mark = Mark{};
}

std::vector<TraceSpan> Tracer::spans() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spans_;
}

void Tracer::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  spans_.clear();
}

std::string Tracer::flush() const {
  if (!enabled()) return "";
  ::mkdir(dir_.c_str(), 0755);  // one level; an existing directory is fine
  const std::string path = dir_ + "/trace_rank" + std::to_string(rank_) + ".json";
  static const char* kStreams[] = {"compute", "all_gather", "reduce"};
  std::ostringstream os;
  os << "{\"traceEvents\":[\n";
  bool first = true;
  for (int tid = 0; tid < 3; ++tid) {
    os << (first ? "" : ",\n") << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << rank_
       << ",\"tid\":" << tid << ",\"args\":{\"name\":\"" << kStreams[tid] << "\"}}";
    first = false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& s : spans_) {
    os << ",\n{\"name\":\"" << json_escape(s.name) << "\",\"ph\":\"X\",\"pid\":" << rank_
       << ",\"tid\":" << s.tid << ",\"ts\":" << s.begin_us << ",\"dur\":" << (s.end_us - s.begin_us)
       << ",\"args\":{\"begin_seq\":" << s.begin_seq << ",\"end_seq\":" << s.end_seq;
    if (!s.transport.empty()) os << ",\"transport\":\"" << json_escape(s.transport) << "\"";
    os << "}}";
  }
  os << "\n],\"displayTimeUnit\":\"ms\"}\n";
  std::ofstream f(path);
  TORCH_CHECK(f.good(), "fsdp: cannot write the trace file ", path, " (rank ", rank_,
              "); check that the trace directory exists and is writable");
  f << os.str();
  return path;
}

}  // namespace fsdp
