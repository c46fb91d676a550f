#include "checkpoint_dir.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "resume.h"

namespace fsdp::train {

namespace fs = std::filesystem;

std::vector<int64_t> checkpoint_steps(const std::string& dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.size() == 5) continue;
    const std::string digits = name.substr(5);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (digits.size() > 18 || !it->is_directory(ec)) continue;
    steps.push_back(std::stoll(digits));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<int64_t> newest_usable_checkpoint(const TrainOptions& o, std::vector<std::string>& skipped,
                                                int64_t below) {
  std::vector<int64_t> steps = checkpoint_steps(o.checkpoint_dir);
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

std::string prune_checkpoints(const std::string& dir, int64_t keep) {
  std::vector<int64_t> steps = checkpoint_steps(dir);
  std::string failed;
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < steps.size(); ++i) {
    const std::string path = checkpoint_path(dir, steps[i]);
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) failed += (failed.empty() ? "" : "; ") + path + ": " + ec.message();
  }
  return failed;
}

}  // namespace fsdp::train
