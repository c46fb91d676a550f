// The skip rules of the test harness ([Note: skips], harness/skips.h): the exit status a test
// binary reports from what its cases did.
//
// The DISABLED_ cases are subjects for tests/scripts/test_skip_rules.sh, which runs them a
// selection at a time (--gtest_also_run_disabled_tests) and checks the binary's exit status and
// output; a normal run leaves them out.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness/gpu.h"
#include "harness/multirank.h"
#include "harness/skips.h"

using namespace fsdp;
using fsdp::testing::exit_status;
using fsdp::testing::kSkipExitStatus;
using fsdp::testing::SkipTally;

namespace {

SkipTally tally(int ran, int skipped, int gpu_skipped) {
  SkipTally t;
  t.ran = ran;
  t.skipped = skipped;
  t.gpu_skipped = gpu_skipped;
  for (int i = 0; i < skipped; ++i) t.skips.push_back("Suite.Case" + std::to_string(i) + ": why " + std::to_string(i));
  return t;
}

int status_of(int gtest_status, const SkipTally& t, const std::string& strict = "") {
  std::vector<std::string> report;
  const int status = exit_status(gtest_status, t, strict, &report);
  EXPECT_EQ(report.size(), strict.empty() ? 0u : static_cast<size_t>(t.skipped));
  return status;
}

}  // namespace

TEST(HarnessSkips, SkippedOnlyWhenEveryCaseLackedAGpu) {
  EXPECT_EQ(status_of(0, tally(3, 3, 3)), kSkipExitStatus);
  EXPECT_EQ(status_of(0, tally(3, 2, 2)), 0) << "a case passed";
  EXPECT_EQ(status_of(0, tally(2, 2, 1)), 0) << "a skip for another reason";
  EXPECT_EQ(status_of(0, tally(1, 1, 0)), 0) << "no GPU skip at all";
  EXPECT_EQ(status_of(1, tally(3, 2, 2)), 1) << "a case failed";
  EXPECT_EQ(status_of(0, tally(0, 0, 0)), 0) << "nothing selected";
}

TEST(HarnessSkips, StrictModesFailEverySkipNamingIt) {
  std::vector<std::string> report;
  EXPECT_EQ(exit_status(0, tally(3, 2, 1), "CI=true", &report), 1);
  ASSERT_EQ(report.size(), 2u);
  EXPECT_EQ(report[0], "skip not allowed under CI=true: Suite.Case0: why 0");
  EXPECT_EQ(report[1], "skip not allowed under CI=true: Suite.Case1: why 1");
  EXPECT_EQ(status_of(0, tally(2, 2, 2), "FSDP_REQUIRE_GPU=1"), 1) << "GPU skips too";
  EXPECT_EQ(status_of(1, tally(2, 1, 0), "CI=true"), 1) << "a failure stays one";
  EXPECT_EQ(status_of(0, tally(2, 0, 0), "CI=true"), 0) << "no skip, nothing to fail";
}

// --- subjects for tests/scripts/test_skip_rules.sh ------------------------------------------

TEST(HarnessSkips, DISABLED_Passes) {}

// More devices than any machine has: a GPU skip on every machine, GPU or not.
TEST(HarnessSkips, DISABLED_NeedsMoreGpusThanAnyMachine) { FSDP_SKIP_WITHOUT_GPU(1 << 16); }

TEST(HarnessSkips, DISABLED_NeedsOneGpu) { FSDP_SKIP_WITHOUT_GPU(1); }

TEST(HarnessSkips, DISABLED_SkipsForAnotherReason) { GTEST_SKIP() << "a reason that is not a missing GPU"; }

// A failure whose message reads like a skip's must stay a failure.
TEST(HarnessSkips, DISABLED_FailsSayingNoCudaDevice) {
  ADD_FAILURE() << "no CUDA device: this failure says so, and is still a failure";
}

// A skip decided too late, inside the ranks.
TEST(HarnessSkips, DISABLED_SkipsInsideRanks) {
  fsdp::testing::run_ranks(2, [](comm::ProcessGroup& pg) { GTEST_SKIP() << "decided by rank " << pg.rank(); });
}
