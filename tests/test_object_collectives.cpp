// broadcast_object / all_gather_object (src/comm/object_collectives.h) at world
// sizes 1-3 against the strings each rank made: lengths that differ by rank,
// empty strings, and bytes a C string would cut (NUL, 0xff).
#include <gtest/gtest.h>

#include <string>

#include "comm/object_collectives.h"
#include "harness/multirank.h"

using namespace fsdp;
using fsdp::testing::run_case;
using fsdp::testing::run_ranks;

namespace {

// Rank r's message: 3r bytes, including NUL and 0xff; empty on rank 0.
std::string message_of(int r) {
  std::string s;
  for (int i = 0; i < 3 * r; ++i) s.push_back(static_cast<char>(i % 3 == 0 ? 0 : (i % 3 == 1 ? 0xff : 'a' + r)));
  return s;
}

void object_cases(comm::ProcessGroup& pg) {
  const int n = pg.size();
  run_case("all_gather_object", [&] {
    const auto all = comm::all_gather_object(pg, message_of(pg.rank()));
    ASSERT_EQ(static_cast<int>(all.size()), n);
    for (int r = 0; r < n; ++r) EXPECT_EQ(all[r], message_of(r)) << "rank " << r << "'s string";
  });
  run_case("broadcast_object from every root", [&] {
    for (int root = 0; root < n; ++root) {
      // Non-root ranks pass something else, which must be ignored.
      const std::string mine = pg.rank() == root ? message_of(root + 1) : std::string(7, 'x');
      EXPECT_EQ(comm::broadcast_object(pg, mine, root), message_of(root + 1)) << "root " << root;
    }
    EXPECT_EQ(comm::broadcast_object(pg, pg.rank() == 0 ? std::string() : std::string("not empty")), "");
  });
}

}  // namespace

TEST(ObjectCollectives, WorldSizes1To3) {
  for (int n = 1; n <= 3; ++n) run_ranks(n, object_cases);
}
