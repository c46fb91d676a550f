#include "metrics.h"

#include <sys/resource.h>

#include <stdexcept>

#include <nlohmann/json.hpp>
#include <unistd.h>

namespace fsdp::train {

MetricsWriter::MetricsWriter(const std::string& path) {
  if (path.empty()) return;
  out_.open(path, std::ios::out | std::ios::trunc);
  if (!out_) throw std::runtime_error("--metrics " + path + ": cannot create the file (check the directory exists)");
  enabled_ = true;
}

void MetricsWriter::write_step(int64_t step, double loss, double lr, double samples_per_s,
                               const MemorySample& m) {
  if (!enabled_) return;
  nlohmann::json j = {{"step", step},
                      {"loss", loss},
                      {"lr", lr},
                      {"samples_per_s", samples_per_s},
                      {"memory",
                       {{"param_bytes", m.param_bytes},
                        {"grad_bytes", m.grad_bytes},
                        {"optim_bytes", m.optim_bytes},
                        {"unsharded_peak_bytes", m.unsharded_peak_bytes},
                        {"rss_bytes", m.rss_bytes}}}};
  out_ << j.dump() << '\n' << std::flush;
}

void MetricsWriter::write_eval(int64_t step, double loss, double accuracy) {
  if (!enabled_) return;
  nlohmann::json j = {{"step", step}, {"eval", {{"loss", loss}, {"accuracy", accuracy}}}};
  out_ << j.dump() << '\n' << std::flush;
}

int64_t current_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return resident * int64_t(sysconf(_SC_PAGESIZE));
}

int64_t peak_rss_bytes() {
  struct rusage ru {};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return int64_t(ru.ru_maxrss) * 1024;  // KiB on Linux
}

}  // namespace fsdp::train
