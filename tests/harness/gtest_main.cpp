// gtest main shared by every test binary. A process started as a rank worker of a
// multi-rank test (tests/harness/multirank.h) runs only the test that spawned it. A crash
// prints the frames that led to it before the process dies, so that a segfault on a
// machine without a debugger still says where it happened. The exit status follows the skip
// rules ([Note: skips], harness/skips.h): 77 when every case skipped for want of a GPU, a failure
// for any skip under CI=true or FSDP_REQUIRE_GPU=1.
#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness/multirank.h"
#include "harness/skips.h"

namespace {

void print_frames_and_die(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char* what = strsignal(sig);
  (void)!write(2, "\n*** test process crashed: ", 27);
  (void)!write(2, what, std::strlen(what));
  (void)!write(2, "; frames:\n", 10);
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

int main(int argc, char** argv) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, print_frames_and_die);
  ::testing::InitGoogleTest(&argc, argv);
  fsdp::testing::configure_worker_process();
  const fsdp::testing::SkipTally& tally = fsdp::testing::track_skips();
  const int gtest_status = RUN_ALL_TESTS();
  std::vector<std::string> report;
  const int status = fsdp::testing::exit_status(gtest_status, tally, fsdp::testing::strict_modes(), &report);
  for (const auto& line : report) std::cout << line << "\n";
  std::cout << std::flush;
  return status;
}
