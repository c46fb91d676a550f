// Collectives at world sizes 1-4 against values computed by hand, including flat
// buffers that need padding, the bytes each op reports, and sub-groups.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/dist/collectives.h"
#include "harness/multirank.h"

using namespace fsdp;
using fsdp::testing::run_case;
using fsdp::testing::run_ranks;

namespace {

// Element i of rank r's input: a value no two (rank, index) pairs share, so a
// misplaced chunk cannot go unnoticed.
torch::Tensor rank_values(int64_t numel, int rank, torch::Dtype dtype = torch::kFloat) {
  return (torch::arange(numel, torch::kDouble) + 1000.0 * (rank + 1)).to(dtype);
}

void collective_cases(dist::ProcessGroup& pg) {
  const int n = pg.size();
  const int r = pg.rank();

  // Sizes that do and do not divide by the world size; padded to a multiple.
  for (int64_t numel : {1, 5, 64, 1001}) {
    const int64_t padded = dist::padded_numel(numel, n);
    const int64_t chunk = padded / n;
    run_case("all_gather numel=" + std::to_string(numel), [&] {
      auto shard = rank_values(chunk, r);
      auto flat = torch::full({padded}, -1.0f);
      dist::comm_counters().reset();
      dist::all_gather_into(pg, flat, shard).wait();
      for (int src = 0; src < n; ++src) {
        EXPECT_TRUE(torch::equal(flat.slice(0, src * chunk, (src + 1) * chunk), rank_values(chunk, src)))
            << "chunk of rank " << src;
      }
      EXPECT_EQ(dist::comm_counters().all_gather.load(), int64_t(4) * chunk * (n - 1));
    });
    run_case("reduce_scatter sum numel=" + std::to_string(numel), [&] {
      auto flat = rank_values(padded, r);
      auto out = torch::empty({chunk});
      dist::comm_counters().reset();
      dist::reduce_scatter(pg, out, flat, dist::ReduceOp::Sum).wait();
      // sum over ranks q of (i + 1000 (q+1)) for i in my chunk
      auto idx = torch::arange(r * chunk, (r + 1) * chunk, torch::kDouble);
      auto expected = (idx * n + 1000.0 * n * (n + 1) / 2).to(torch::kFloat);
      EXPECT_TRUE(torch::equal(out, expected)) << out << expected;
      EXPECT_EQ(dist::comm_counters().reduce_scatter.load(), int64_t(4) * chunk * (n - 1));
    });
    run_case("reduce_scatter avg numel=" + std::to_string(numel), [&] {
      auto flat = rank_values(padded, r, torch::kDouble);
      auto out = torch::empty({chunk}, torch::kDouble);
      dist::reduce_scatter(pg, out, flat, dist::ReduceOp::Avg).wait();
      auto idx = torch::arange(r * chunk, (r + 1) * chunk, torch::kDouble);
      auto expected = idx + 1000.0 * (n + 1) / 2;
      EXPECT_TRUE(torch::allclose(out, expected, 0, 1e-9)) << out << expected;
    });
  }
  run_case("all_reduce", [&] {
    auto t = rank_values(7, r);
    dist::comm_counters().reset();
    dist::all_reduce(pg, t, dist::ReduceOp::Sum).wait();
    auto expected = (torch::arange(7, torch::kDouble) * n + 1000.0 * n * (n + 1) / 2).to(torch::kFloat);
    EXPECT_TRUE(torch::equal(t, expected));
    EXPECT_EQ(dist::comm_counters().all_reduce.load(), 2 * 28 * (n - 1) / n);
    auto a = torch::full({3}, double(r + 1), torch::kDouble);
    dist::all_reduce(pg, a, dist::ReduceOp::Avg).wait();
    EXPECT_DOUBLE_EQ(a[0].item<double>(), (n + 1) / 2.0);
  });
  run_case("broadcast", [&] {
    for (int root = 0; root < n; ++root) {
      auto t = rank_values(9, r);
      dist::broadcast(pg, t, root).wait();
      EXPECT_TRUE(torch::equal(t, rank_values(9, root))) << "root " << root;
    }
  });
  run_case("async handles overlap", [&] {
    // Several collectives in flight at once complete independently.
    auto a = rank_values(n * 3, r), b = torch::empty({n * 3});
    auto s = rank_values(2, r), out = torch::empty({2});
    auto h1 = dist::all_gather_into(pg, b, rank_values(3, r));
    auto h2 = dist::reduce_scatter(pg, out, rank_values(2 * n, r));
    h2.wait();
    h1.wait();
    h1.wait();  // idempotent
    for (int src = 0; src < n; ++src) EXPECT_TRUE(torch::equal(b.slice(0, 3 * src, 3 * src + 3), rank_values(3, src)));
  });
  run_case("bad sizes are rejected with the group name", [&] {
    try {
      dist::all_gather_into(pg, torch::empty({n * 2 + 1}), torch::empty({2}));
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("group 'world'"), std::string::npos) << e.what();
    }
  });
  if (n >= 2) {
    run_case("subgroups", [&] {
      // Consecutive blocks of 2 (where it divides) and strided groups.
      if (n % 2 == 0) {
        auto block = pg.split_consecutive(2);
        ASSERT_TRUE(block.defined());
        EXPECT_EQ(block.size(), 2);
        EXPECT_EQ(block.rank(), r % 2);
        auto t = torch::full({1}, float(r));
        dist::all_reduce(block, t).wait();
        const int base = r / 2 * 2;
        EXPECT_EQ(t.item<float>(), float(base + base + 1));
        auto strided = pg.split_strided(2);
        auto u = torch::full({1}, float(r));
        dist::all_reduce(strided, u).wait();
        float expect = 0;
        for (int q = r % 2; q < n; q += 2) expect += q;
        EXPECT_EQ(u.item<float>(), expect);
        EXPECT_NE(strided.name(), block.name());
      }
      // A group that leaves rank 0 out.
      std::vector<int> tail;
      for (int q = 1; q < n; ++q) tail.push_back(q);
      auto g = pg.new_subgroup(tail);
      EXPECT_EQ(g.defined(), r != 0);
      if (g.defined()) {
        EXPECT_EQ(g.rank(), r - 1);
        EXPECT_EQ(g.global_ranks(), tail);
        auto t = torch::ones({2});
        dist::all_reduce(g, t).wait();
        EXPECT_EQ(t[0].item<float>(), float(n - 1));
      }
    });
  }
  dist::barrier(pg);
}

}  // namespace

TEST(Collectives, WorldSizes1To4) {
  for (int n = 1; n <= 4; ++n) run_ranks(n, collective_cases);
}
