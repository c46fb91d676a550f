#include "fsdp/trainer/checkpoint_dir.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <system_error>

#include <nlohmann/json.hpp>

namespace fsdp::trainer {

namespace fs = std::filesystem;

std::string checkpoint_path(const std::string& dir, int64_t step) { return dir + "/step-" + std::to_string(step); }

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

PruneResult prune_checkpoints(const std::string& dir, int64_t keep) {
  const std::vector<int64_t> steps = checkpoint_steps(dir);
  PruneResult result;
  for (size_t i = 0; i + size_t(keep) < steps.size(); ++i) {
    const std::string path = checkpoint_path(dir, steps[i]);
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) result.failed += (result.failed.empty() ? "" : "; ") + path + ": " + ec.message();
    else result.deleted.push_back(path);
  }
  return result;
}

bool read_checkpoint_values(const std::string& dir, std::vector<std::pair<std::string, std::string>>& values,
                            std::string& error) {
  std::ifstream in(dir + "/metadata.json");
  if (!in) in = std::ifstream(dir + ".old/metadata.json");  // load_checkpoint's crash fallback
  if (!in) {
    error = "no checkpoint there (cannot read " + dir + "/metadata.json)";
    return false;
  }
  try {
    auto meta = nlohmann::json::parse(in);
    if (meta.contains("extra"))
      for (auto& [k, v] : meta.at("extra").items()) values.emplace_back(k, v.get<std::string>());
  } catch (const std::exception& e) {
    error = std::string("unreadable metadata.json (") + e.what() + ")";
    return false;
  }
  return true;
}

}  // namespace fsdp::trainer
