#include "resume.h"

#include <cstdio>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

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
  // "auto" is resolved by rank 0 once the job runs (newest_usable_checkpoint).
  if (o.resume.empty() || o.resume == "auto") return "";
  std::string dir = o.resume;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  std::vector<std::pair<std::string, std::string>> values;
  std::string why;
  if (!fsdp::trainer::read_checkpoint_values(dir, values, why)) {
    const bool missing = why.rfind("no checkpoint there", 0) == 0;
    return "--resume " + o.resume + ": " + why +
           (missing ? "; pass a directory that --checkpoint-dir DIR wrote, such as DIR/step-S" : "");
  }
  return check_compatible(o, std::map<std::string, std::string>(values.begin(), values.end()));
}

std::optional<int64_t> newest_usable_checkpoint(const TrainOptions& o, std::vector<std::string>& skipped,
                                                int64_t below) {
  const std::vector<int64_t> steps = fsdp::trainer::checkpoint_steps(o.checkpoint_dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (*it >= below) continue;
    TrainOptions candidate = o;
    candidate.resume = checkpoint_path(o.checkpoint_dir, *it);
    std::string err = check_resume(candidate);
    if (err.empty()) return *it;
    skipped.push_back(err);
  }
  return std::nullopt;
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
