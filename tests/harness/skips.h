#pragma once
// [Note: skips] How a skipped case reaches ctest.
//
// A case skips (GTEST_SKIP) when this machine cannot run its subject, saying why. Every test
// binary's gtest_main decides its exit status from what its cases did, and ctest reads only
// that status (SKIP_RETURN_CODE 77, tests/CMakeLists.txt), never the output, so a failure
// whose message happens to say "no CUDA device" stays a failure:
//   - 77 (ctest: skipped) when every case that ran skipped for want of a GPU, through
//     FSDP_SKIP_WITHOUT_GPU (harness/gpu.h): the gpu-labelled tests on a CPU machine;
//   - otherwise gtest's own status: a run that mixes passes with skips passes, and gtest's
//     "Skipped" lines say which cases did not run and why.
// Strict modes, CI=true (.ci/run) and FSDP_REQUIRE_GPU=1 (a GPU machine's run), allow no skip
// at all, whatever its reason: the binary prints one "skip not allowed under ..." line per
// skipped case and fails. A rank worker must not skip either (harness/multirank.cpp): a skip is
// decided in the parent, before run_ranks, so that all ranks agree and ctest sees it.
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace fsdp::testing {

/// What the cases of this process did, filled by the listener track_skips() installs.
struct SkipTally {
  int ran = 0;                     ///< cases that ran (disabled or filtered-out ones do not)
  int skipped = 0;                 ///< of those, cases that ended skipped
  int gpu_skipped = 0;             ///< of those, skips through FSDP_SKIP_WITHOUT_GPU
  std::vector<std::string> skips;  ///< "Suite.Case: reason", one per skipped case
};

/// Process exit status for "every case skipped for want of a GPU"; ctest's SKIP_RETURN_CODE.
constexpr int kSkipExitStatus = 77;

/// Marks the running case's skip as one for want of a GPU (FSDP_SKIP_WITHOUT_GPU calls it).
void note_gpu_skip();

/// The reason a case's result gives for its skip ("no reason given" when it gave none), or ""
/// when the case did not skip.
std::string skip_reason(const ::testing::TestResult& result);

/// The strict modes set in this environment ("CI=true", "FSDP_REQUIRE_GPU=1", or both joined by
/// " and "), "" when none is.
std::string strict_modes();

/// Installs a gtest listener (once, after InitGoogleTest) that counts into the tally returned.
const SkipTally& track_skips();

/// The status a test binary exits with, from gtest's status, the tally and the strict modes
/// ([Note: skips]). `report` gets the lines to print ("skip not allowed under ...").
int exit_status(int gtest_status, const SkipTally& tally, const std::string& strict,
                std::vector<std::string>* report);

}  // namespace fsdp::testing
