#pragma once
// One directory per test process, shared with its rank workers, for files the ranks write and
// read across run_ranks calls (checkpoints, references). The test process makes it on first use
// and removes it when it exits, after its workers have; a worker borrows its launcher's, which
// rank_options() names to it in FSDP_TEST_DIR.
#include <chrono>
#include <string>

#include "harness/multirank.h"
#include "harness/temp_dir.h"

namespace fsdp::testing {

inline const std::string& test_dir() {
  static const TempDir dir = TempDir::from_env_or_create("FSDP_TEST_DIR", "fsdp-test-dir-");
  return dir.path();
}

/// RankOptions whose workers borrow test_dir(); `deadline` bounds the whole run, all ranks.
inline RankOptions rank_options(std::chrono::seconds deadline = RankOptions{}.deadline) {
  RankOptions o;
  o.deadline = deadline;
  o.extra_env.push_back("FSDP_TEST_DIR=" + test_dir());
  return o;
}

}  // namespace fsdp::testing
