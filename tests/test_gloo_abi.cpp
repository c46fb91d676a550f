// Gloo's headers do not come with the torch wheel: the build takes Debian's libgloo-dev, a
// different Gloo commit than the one compiled into libtorch_cpu. That is safe only while
// nothing we compile depends on the layout of a Gloo type. This test pins down why it holds
// and drives every Gloo path the library uses:
//  - our code touches Gloo only through std::shared_ptr<gloo::transport::Device> (opaque);
//  - c10d::ProcessGroupGloo::Options, which we allocate from its inline create() and the
//    library fills in create_default(), has the same size and field offsets on both sides;
//  - a ProcessGroupGloo we allocate (make_intrusive, our sizeof) is constructed and used by
//    the library: every c10d collective we issue on Gloo (allreduce, broadcast, alltoall_base,
//    send, recv, barrier) gives the values computed by hand, on CPU tensors.
#include <malloc.h>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "fsdp/comm/process_group.h"
#include "harness/multirank.h"

using fsdp::testing::run_case;
using fsdp::testing::run_ranks;

namespace {

using Options = c10d::ProcessGroupGloo::Options;

TEST(GlooAbi, OptionsLayoutAgreesWithTheLibrary) {
  // create() is inline: allocated with the size our headers give. create_default() is
  // compiled into libtorch_cpu: allocated and filled with the library's layout.
  auto ours = Options::create(std::chrono::milliseconds(1234));
  auto theirs = Options::create_default(std::chrono::milliseconds(4321));
  EXPECT_EQ(malloc_usable_size(ours.get()), malloc_usable_size(theirs.get()));
  // Fields the library wrote, read at our offsets.
  EXPECT_EQ(theirs->timeout, std::chrono::milliseconds(4321));
  ASSERT_GE(theirs->devices.size(), 1u);
  ASSERT_LE(theirs->devices.size(), 64u);
  for (const auto& d : theirs->devices) EXPECT_NE(d, nullptr);
  EXPECT_GE(theirs->threads, 1);
  EXPECT_LE(theirs->threads, 1024);
  EXPECT_EQ(ours->threads, 2);  // the header's default member initializer
}

TEST(GlooAbi, BackendWeAllocateServesOneRank) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto opts = Options::create(std::chrono::milliseconds(10000));
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, opts);
  EXPECT_EQ(gloo->getBackendName(), "gloo");
  EXPECT_EQ(gloo->getRank(), 0);
  EXPECT_EQ(gloo->getSize(), 1);
  std::vector<at::Tensor> t{torch::arange(5, torch::kFloat)};
  gloo->allreduce(t)->wait();
  EXPECT_TRUE(t[0].equal(torch::arange(5, torch::kFloat)));
}

// Every c10d call the library makes on Gloo (src/comm: gloo_transport, gloo_p2p,
// gloo_alltoall, process_group), through the c10d::ProcessGroup the library builds.
void every_gloo_path(fsdp::comm::ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  auto& c = pg.c10d();
  ASSERT_EQ(c->getBackend(c10::kCPU)->getBackendName(), "gloo");
  run_case("allreduce", [&] {
    std::vector<at::Tensor> t{torch::full({7}, double(r + 1), torch::kDouble)};
    c->allreduce(t)->wait();
    EXPECT_TRUE(t[0].equal(torch::full({7}, n * (n + 1) / 2.0, torch::kDouble)));
  });
  run_case("broadcast from the last rank", [&] {
    std::vector<at::Tensor> t{torch::full({3}, float(r), torch::kFloat)};
    c10d::BroadcastOptions o;
    o.rootRank = n - 1;
    c->broadcast(t, o)->wait();
    EXPECT_TRUE(t[0].equal(torch::full({3}, float(n - 1))));
  });
  run_case("alltoall_base", [&] {
    // Rank r sends element 100*r + q to rank q, and receives 100*q + r from each q.
    auto in = torch::arange(n, torch::kInt64) + 100 * r;
    auto out = torch::empty({n}, torch::kInt64);
    std::vector<int64_t> splits(n, 1);
    c->alltoall_base(out, in, splits, splits)->wait();
    EXPECT_TRUE(out.equal(torch::arange(n, torch::kInt64) * 100 + r));
  });
  run_case("send and recv in a ring", [&] {
    if (n == 1) return;
    std::vector<at::Tensor> to{torch::full({4}, float(r))};
    std::vector<at::Tensor> from{torch::empty({4})};
    auto s = c->send(to, (r + 1) % n, 7);
    auto v = c->recv(from, (r + n - 1) % n, 7);
    s->wait();
    v->wait();
    EXPECT_TRUE(from[0].equal(torch::full({4}, float((r + n - 1) % n))));
  });
  run_case("barrier", [&] { c->barrier()->wait(); });
}

TEST(GlooAbi, EveryGlooPathWeUse) {
  fsdp::testing::RankOptions o;
  o.extra_env = {"FSDP_SHARED_MEMORY=0"};
  for (int n : {2, 3}) run_ranks(n, every_gloo_path, o);
}

}  // namespace
