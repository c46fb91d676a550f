#include "fsdp/trainer/metrics_log.h"

#include <sys/resource.h>
#include <unistd.h>

#include <utility>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace fsdp::trainer {

MetricsLog::MetricsLog(const std::string& path, bool append, std::string validation_key)
    : validation_key_(std::move(validation_key)) {
  if (path.empty()) return;
  out_.open(path, std::ios::out | (append ? std::ios::app : std::ios::trunc));
  TORCH_CHECK(out_.good(), "metrics file ", path, ": cannot open it for writing (does the directory exist?)");
  enabled_ = true;
}

void MetricsLog::write_step(const StepMetrics& m) {
  if (!enabled_) return;
  nlohmann::json j = {{"step", m.step},
                      {"epoch", m.epoch},
                      {"loss", m.loss},
                      {"samples", m.samples},
                      {"lr", m.lr},
                      {"samples_per_s", m.samples_per_s},
                      {"memory",
                       {{"param_bytes", m.memory.param_bytes},
                        {"grad_bytes", m.memory.grad_bytes},
                        {"optim_bytes", m.memory.optim_bytes},
                        {"unsharded_peak_bytes", m.memory.unsharded_peak_bytes},
                        {"rss_bytes", m.memory.rss_bytes}}}};
  if (m.checkpoint) {
    const CheckpointSaveStats& c = m.checkpoint->second;
    j["checkpoint"] = {{"step", m.checkpoint->first},
                       {"blocked_s", c.blocked_s},
                       {"snapshot_s", c.snapshot_s},
                       {"cow_pages_copied", c.cow_pages_copied},
                       {"cow_fault_s", c.cow_fault_s},
                       {"cow_wait_s", c.cow_wait_s},
                       {"background_s", c.background_s},
                       {"bytes", c.file_bytes},
                       {"gb_s", c.background_s > 0 ? double(c.file_bytes) / c.background_s / 1e9 : 0.0}};
  }
  out_ << j.dump() << '\n' << std::flush;
}

void MetricsLog::write_validation(const ValidationMetrics& m) {
  if (!enabled_) return;
  nlohmann::json values = nlohmann::json::object();
  for (const auto& [k, v] : m.values) values[k] = v;
  nlohmann::json j = {{"step", m.step}, {validation_key_, values}, {"samples", m.samples}};
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

}  // namespace fsdp::trainer
