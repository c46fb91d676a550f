#include "harness/skips.h"

#include <cstdlib>
#include <set>

namespace fsdp::testing {

namespace {

// The cases that skipped through FSDP_SKIP_WITHOUT_GPU, by their gtest record.
std::set<const ::testing::TestInfo*>& gpu_skip_cases() {
  static std::set<const ::testing::TestInfo*> cases;
  return cases;
}

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == value;
}

class SkipCounter : public ::testing::EmptyTestEventListener {
 public:
  explicit SkipCounter(SkipTally* tally) : tally_(tally) {}

  void OnTestEnd(const ::testing::TestInfo& info) override {
    ++tally_->ran;
    if (!info.result()->Skipped()) return;
    ++tally_->skipped;
    if (gpu_skip_cases().count(&info) != 0) ++tally_->gpu_skipped;
    tally_->skips.push_back(std::string(info.test_suite_name()) + "." + info.name() + ": " +
                            skip_reason(*info.result()));
  }

 private:
  SkipTally* tally_;
};

}  // namespace

void note_gpu_skip() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info != nullptr) gpu_skip_cases().insert(info);
}

std::string skip_reason(const ::testing::TestResult& result) {
  for (int i = 0; i < result.total_part_count(); ++i) {
    const auto& part = result.GetTestPartResult(i);
    if (!part.skipped()) continue;
    // gtest's message is "Skipped", then the streamed reason on a line of its own.
    std::string why = part.message();
    const std::string head = "Skipped";
    if (why.compare(0, head.size(), head) == 0) why.erase(0, head.size());
    if (!why.empty() && why.front() == '\n') why.erase(0, 1);
    return why.empty() ? "no reason given" : why;
  }
  return "";
}

std::string strict_modes() {
  std::string modes;
  if (env_is("CI", "true")) modes = "CI=true";
  if (env_is("FSDP_REQUIRE_GPU", "1")) modes += std::string(modes.empty() ? "" : " and ") + "FSDP_REQUIRE_GPU=1";
  return modes;
}

const SkipTally& track_skips() {
  static SkipTally tally;
  static bool installed = false;
  if (!installed) {
    ::testing::UnitTest::GetInstance()->listeners().Append(new SkipCounter(&tally));
    installed = true;
  }
  return tally;
}

int exit_status(int gtest_status, const SkipTally& tally, const std::string& strict,
                std::vector<std::string>* report) {
  if (!strict.empty() && tally.skipped > 0) {
    for (const auto& skip : tally.skips) report->push_back("skip not allowed under " + strict + ": " + skip);
    return gtest_status != 0 ? gtest_status : 1;
  }
  const bool all_for_want_of_a_gpu = tally.ran > 0 && tally.gpu_skipped == tally.ran;
  if (gtest_status == 0 && all_for_want_of_a_gpu) return kSkipExitStatus;
  return gtest_status;
}

}  // namespace fsdp::testing
