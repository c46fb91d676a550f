#include "resume.h"

#include <cstdio>
#include <fstream>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace fsdp::train {

namespace {

constexpr const char* kStepKey = "step";
constexpr const char* kRngKey = "torch_cpu_rng";
constexpr const char* kMarkerKey = "fsdp_train";

std::string format_double(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

/// (flag, value) of every flag that fixes the model, the data order or the optimizer.
std::vector<std::pair<std::string, std::string>> fixed_flags(const TrainOptions& o) {
  std::vector<std::pair<std::string, std::string>> f = {{"--model", o.model}};
  if (o.model == "mlp") f.emplace_back("--hidden", std::to_string(o.hidden));
  if (o.model == "gpt")
    for (auto [flag, v] : {std::pair{"--layers", o.layers}, std::pair{"--dim", o.dim}, std::pair{"--heads", o.heads},
                           std::pair{"--context", o.context}})
      f.emplace_back(flag, std::to_string(v));
  f.emplace_back("--seed", std::to_string(o.seed));
  f.emplace_back("--batch-size", std::to_string(o.batch_size));
  f.emplace_back("--no-shuffle", o.shuffle ? "not given" : "given");
  f.emplace_back("--optimizer", o.optimizer);
  f.emplace_back("--lr", format_double(o.effective_lr()));
  return f;
}

}  // namespace

std::string checkpoint_path(const std::string& dir, int64_t step) {
  return dir + "/step-" + std::to_string(step);
}

fsdp::CheckpointExtra training_state(const TrainOptions& o, int64_t step) {
  fsdp::CheckpointExtra e;
  e.values[kMarkerKey] = "1";
  e.values[kStepKey] = std::to_string(step);
  for (auto& [flag, value] : fixed_flags(o)) e.values[flag] = value;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  e.tensors[kRngKey] = gen.get_state();
  return e;
}

std::string check_compatible(const TrainOptions& o, const std::map<std::string, std::string>& saved) {
  if (saved.count(kMarkerKey) == 0 || saved.count(kStepKey) == 0)
    return "--resume " + o.resume +
           ": this checkpoint was not written by fsdp-train --checkpoint-dir (no step in its extras); "
           "resume from a DIR/step-S directory fsdp-train wrote";
  for (auto& [flag, value] : fixed_flags(o)) {
    auto it = saved.find(flag);
    const std::string was = it == saved.end() ? "(not recorded)" : it->second;
    if (was == value) continue;
    std::string fix = flag == "--no-shuffle" ? (was == "given" ? "add --no-shuffle" : "drop --no-shuffle")
                                             : "pass " + flag + " " + was;
    return "--resume " + o.resume + ": the checkpoint was saved with " + flag + " " + was + " but this run has " +
           flag + " " + value + "; a resumed run must train the same model on the same data: " + fix;
  }
  return "";
}

std::string check_resume(const TrainOptions& o) {
  // "auto" is resolved by rank 0 once the job runs (checkpoint_dir.h).
  if (o.resume.empty() || o.resume == "auto") return "";
  std::string dir = o.resume;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  std::ifstream in(dir + "/metadata.json");
  if (!in) in = std::ifstream(dir + ".old/metadata.json");  // load_checkpoint's crash fallback
  if (!in)
    return "--resume " + o.resume + ": no checkpoint there (cannot read " + dir +
           "/metadata.json); pass a directory that --checkpoint-dir DIR wrote, such as DIR/step-S";
  std::map<std::string, std::string> values;
  try {
    auto meta = nlohmann::json::parse(in);
    if (meta.contains("extra"))
      for (auto& [k, v] : meta.at("extra").items()) values[k] = v.get<std::string>();
  } catch (const std::exception& e) {
    return "--resume " + o.resume + ": unreadable metadata.json (" + e.what() + ")";
  }
  return check_compatible(o, values);
}

int64_t restore_training_state(const fsdp::CheckpointExtra& extra) {
  auto step = extra.values.find(kStepKey);
  TORCH_CHECK(step != extra.values.end(), "fsdp-train: the checkpoint has no '", kStepKey,
              "' extra; resume from a directory fsdp-train --checkpoint-dir wrote");
  auto rng = extra.tensors.find(kRngKey);
  if (rng != extra.tensors.end()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng->second);
  }
  return std::stoll(step->second);
}

}  // namespace fsdp::train
