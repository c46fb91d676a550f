// gtest main shared by every test binary. A process started as a rank worker of a
// multi-rank test (tests/harness/multirank.h) runs only the test that spawned it.
#include <gtest/gtest.h>

#include "harness/multirank.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  fsdp::testing::configure_worker_process();
  return RUN_ALL_TESTS();
}
