#include "resume.h"

#include <cstdio>
#include <utility>
#include <vector>

namespace fsdp::train {

namespace {

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

void add_training_state(const TrainOptions& o, fsdp::CheckpointExtra& extra) {
  extra.values[kMarkerKey] = "1";
  for (auto& [flag, value] : fixed_flags(o)) extra.values[flag] = value;
}

std::string check_compatible(const TrainOptions& o, const std::map<std::string, std::string>& saved) {
  if (saved.count(kMarkerKey) == 0)
    return "--resume " + o.resume +
           ": this checkpoint was not written by fsdp-train --checkpoint-dir (no fsdp-train flags in its extras); "
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
  // "auto" is resolved by the loop on rank 0 once the job runs (the resume_check hook).
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

}  // namespace fsdp::train
