// The flight recorder (src/comm/flight_recorder.h): every collective recorded per group, and
// a failed collective's error naming where the ranks first disagree.
//  - The description itself, from hand-made records: a rank that took another path, ranks
//    that disagree on a size, a rank that has not issued what the others wait in, a rank that
//    does not answer, and ranks that agree (nothing to report).
//  - Planted faults at N=2 with a 3 s collective timeout, where every surviving rank's error
//    must name the divergence within the timeout + 5 s: over Gloo, a rank that skips a
//    collective and a rank stuck outside any collective; on the shared-memory transport, a
//    rank whose tensor has another size, caught by the slots' headers within 5 s. (Over Gloo a
//    size mismatch aborts the receiving rank inside Gloo's own thread, with Gloo's message.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "comm/divergence.h"
#include "comm/flight_recorder.h"
#include "fsdp/comm/call_label.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;
using comm::Phase;
using comm::detail::CallRecord;
using comm::detail::describe_divergence;
using comm::detail::RankRecords;
using comm::detail::RecordState;

namespace {

CallRecord rec(uint64_t seq, const char* op, int64_t numel, Phase phase, std::string subject,
               RecordState state = RecordState::Completed) {
  CallRecord r;
  r.seq = seq;
  r.op = op;
  r.dtype = at::kFloat;
  r.numel = numel;
  r.phase = phase;
  r.subject = std::move(subject);
  r.state = state;
  return r;
}

RankRecords rank_of(int rank, std::vector<CallRecord> records) { return {rank, true, std::move(records)}; }

// Ranks 0, 2, 3 run backward of blocks.3 then blocks.2; rank 1 skipped blocks.3's forward, so
// its #57 is blocks.2's gather while the others are in blocks.3's reduce-scatter.
TEST(FlightRecorderText, RankOnAnotherPathIsNamedAgainstTheMajority) {
  auto common = rec(56, "all_gather", 8192, Phase::Forward, "blocks.2");
  std::vector<RankRecords> ranks;
  for (int r = 0; r < 4; ++r) {
    auto at57 = r == 1 ? rec(57, "all_gather", 8192, Phase::Forward, "blocks.3", RecordState::Failed)
                       : rec(57, "reduce_scatter", 8192, Phase::Backward, "blocks.2", RecordState::Failed);
    ranks.push_back(rank_of(r, {common, at57}));
  }
  EXPECT_EQ(describe_divergence("world", ranks),
            "rank 1 is at all_gather #57 (blocks.3, forward) while ranks 0, 2, 3 are at reduce_scatter #57 "
            "(blocks.2, backward)");
}

TEST(FlightRecorderText, SizeMismatchNamesBothSizes) {
  std::vector<RankRecords> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.push_back(rank_of(r, {rec(12, "all_gather", r == 2 ? 4096 : 8192, Phase::Forward, "fc1",
                                    RecordState::Failed)}));
  EXPECT_EQ(describe_divergence("world", ranks),
            "ranks disagree at all_gather #12 (fc1, forward): rank 2 has 4,096 elements, the others 8,192");
}

TEST(FlightRecorderText, RankBehindIsNamedWithItsLastCall) {
  auto first = rec(4, "broadcast", 10, Phase::Setup, "");
  std::vector<RankRecords> ranks = {
      rank_of(0, {first, rec(5, "all_reduce", 1, Phase::Step, "", RecordState::Failed)}),
      rank_of(1, {first}),
  };
  EXPECT_EQ(describe_divergence("world", ranks),
            "rank 0 is at all_reduce #5 (step) while rank 1 has not issued #5 on group 'world'; rank 1's last "
            "is broadcast #4 (setup), completed");
}

TEST(FlightRecorderText, SilentRankIsNamedWhileTheOthersWait) {
  std::vector<RankRecords> ranks = {rank_of(0, {rec(1, "all_reduce", 4, Phase::Step, "", RecordState::Failed)}),
                                    {1, false, {}}};
  EXPECT_EQ(describe_divergence("world", ranks),
            "rank 1 did not answer: not in a collective of group 'world' (stuck elsewhere, or gone), while rank 0 "
            "waits at all_reduce #1 (step)");
}

TEST(FlightRecorderText, AgreeingRanksRunningAheadAreNoDivergence) {
  // Rank 1 is one collective ahead, but the ones both issued match and none is stuck.
  auto a = rec(1, "all_gather", 64, Phase::Forward, "fc1");
  auto b = rec(2, "all_gather", 64, Phase::Forward, "fc2");
  std::vector<RankRecords> ranks = {rank_of(0, {a}), rank_of(1, {a, b})};
  EXPECT_EQ(describe_divergence("world", ranks), "");
}

TEST(FlightRecorderText, RecordsSurviveTheirTextForm) {
  auto r = rec(7, "reduce_scatter", 123456, Phase::Backward, "blocks.0.attn", RecordState::Issued);
  r.site = "src/core/unit.cpp:120";
  auto back = comm::detail::decode_records(comm::detail::encode_records({r, rec(8, "barrier", 0, Phase::Setup, "")}));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_TRUE(back[0].same_call(r));
  EXPECT_EQ(back[0].seq, 7u);
  EXPECT_EQ(back[0].site, r.site);
  EXPECT_EQ(back[0].state, RecordState::Issued);
  EXPECT_EQ(back[1].subject, "");
  EXPECT_EQ(back[0].describe(), "reduce_scatter #7 (blocks.0.attn, backward) at src/core/unit.cpp:120");
}

// ---- planted faults ----

RankOptions faulty_world() {
  RankOptions o;
  o.collective_timeout = std::chrono::milliseconds(3000);
  o.deadline = std::chrono::seconds(60);
  o.extra_env = {"FSDP_SHARED_MEMORY=0"};  // Gloo: mismatched calls wait or fail, never pass
  return o;
}

// Runs `body`, which must throw, and returns the error's message.
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "the planted fault did not fail";
  return "";
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

TEST(FlightRecorderFaults, RankThatSkipsACollectiveIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto t = torch::ones({16});
    comm::all_reduce(pg, t, comm::ReduceOp::Sum, {Phase::Setup, "warm-up"}).wait();
    const auto start = Clock::now();
    const std::string msg = error_of([&] {
      if (pg.rank() == 0) {
        auto flat = torch::zeros({32});
        comm::all_gather_into(pg, flat, torch::ones({16}), {Phase::Forward, "blocks.3"}).wait();
      }
      comm::all_reduce(pg, t, comm::ReduceOp::Sum, {Phase::Step, "loss"}).wait();
    });
    EXPECT_NE(msg.find("rank 0 is at all_gather #2 (blocks.3, forward) at tests/test_flight_recorder.cpp:"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("while rank 1 is at all_reduce #2 (loss, step)"), std::string::npos) << msg;
    EXPECT_LT(seconds_since(start), 3.0 + 5.0);
  }, faulty_world());
}

TEST(FlightRecorderFaults, RankWithAnotherSizeIsCaughtBySharedMemorySlots) {
  RankOptions o = faulty_world();
  o.extra_env.clear();
  run_ranks(2, [](comm::ProcessGroup& pg) {
    ASSERT_NE(pg.shm_channel(), nullptr) << "the shared-memory transport is not in use";
    const int64_t n = pg.rank() == 1 ? 4096 : 8192;
    const auto start = Clock::now();
    const std::string msg = error_of([&] {
      auto t = torch::ones({n});
      comm::all_reduce(pg, t, comm::ReduceOp::Sum, {Phase::Backward, "fc1"}).wait();
      // A transport that let the mismatch pass would meet the next collective here.
      comm::all_reduce(pg, t, comm::ReduceOp::Sum, {Phase::Step, "after"}).wait();
    });
    const std::string peer_bytes = pg.rank() == 0 ? "16,384" : "32,768";
    EXPECT_NE(msg.find("sent data of its all_reduce #1 of " + peer_bytes + " bytes where this rank is at all_reduce #1"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("ranks disagree at all_reduce #1 (fc1, backward): rank 0 has 8,192 elements, rank 1 has 4,096"),
              std::string::npos)
        << msg;
    EXPECT_LT(seconds_since(start), 5.0);
  }, o);
}

TEST(FlightRecorderFaults, RankStuckOutsideACollectiveIsNamedAsNotAnswering) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto t = torch::ones({16});
    if (pg.rank() == 1) {
      // Stuck past the peer's timeout and its exchange, then gone without a word.
      std::this_thread::sleep_for(std::chrono::seconds(8));
      return;
    }
    const auto start = Clock::now();
    const std::string msg = error_of([&] { comm::all_reduce(pg, t, comm::ReduceOp::Sum, {Phase::Step, "loss"}).wait(); });
    EXPECT_NE(msg.find("rank 1 did not answer: not in a collective of group 'world'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("while rank 0 waits at all_reduce #1 (loss, step)"), std::string::npos) << msg;
    EXPECT_LT(seconds_since(start), 3.0 + 5.0);
  }, faulty_world());
}

// ---- a rank that skips one unit's forward ----

// Three units of the same size: a rank that skips blocks1 gathers blocks2 where the others
// gather blocks1, which no transport can tell apart by size.
struct SkippingNetImpl : torch::nn::Module {
  explicit SkippingNetImpl(int skip) : skip(skip) {
    for (int i = 0; i < 3; ++i)
      blocks.push_back(register_module("blocks" + std::to_string(i), fsdp::Wrappable<torch::nn::LinearImpl>(8, 8)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < 3; ++i)
      if (i != skip) x = torch::relu(blocks[i]->forward(x));
    return x;
  }
  int skip;
  std::vector<fsdp::Wrappable<torch::nn::LinearImpl>> blocks;
};
TORCH_MODULE(SkippingNet);

void train_step_skipping_on_rank1(comm::ProcessGroup& pg) {
  torch::manual_seed(0);
  auto model = FullyShardedDataParallel(SkippingNet(pg.rank() == 1 ? 1 : -1), pg,
                                        Options().auto_wrap_policy(always_wrap_policy()));
  model->forward(torch::ones({4, 8})).sum().backward();
}

TEST(FlightRecorderFaults, RankThatSkipsAUnitsForwardIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const auto start = Clock::now();
    const std::string msg = error_of([&] { train_step_skipping_on_rank1(pg); });
    EXPECT_NE(msg.find("rank 0 is at all_gather #"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(blocks1, forward)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("while rank 1 is at all_gather #"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(blocks2, forward)"), std::string::npos) << msg;
    EXPECT_LT(seconds_since(start), 3.0 + 5.0);
  }, faulty_world());
}

// ---- the checked mode ----

RankOptions checked_world() {
  RankOptions o = faulty_world();
  o.collective_timeout = std::chrono::milliseconds(30000);  // the check must not wait for it
  o.extra_env.push_back("FSDP_CHECK_COLLECTIVES=1");
  return o;
}

TEST(FlightRecorderChecked, SkippedUnitFailsAtOnce) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    ASSERT_TRUE(pg.checks_collectives());
    const auto start = Clock::now();
    const std::string msg = error_of([&] { train_step_skipping_on_rank1(pg); });
    EXPECT_NE(msg.find("collective check (FSDP_CHECK_COLLECTIVES)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 0 is at all_gather #"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(blocks1, forward)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(blocks2, forward)"), std::string::npos) << msg;
    EXPECT_LT(seconds_since(start), 5.0);
  }, checked_world());
}

// Over Gloo an unchecked size mismatch aborts the receiving rank inside Gloo; checked, both
// ranks fail before anything moves.
TEST(FlightRecorderChecked, SizeMismatchOverGlooFailsAtOnceOnEveryRank) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const int64_t n = pg.rank() == 1 ? 4096 : 8192;
    const auto start = Clock::now();
    const std::string msg = error_of([&] {
      auto t = torch::ones({n});
      comm::all_reduce(pg, t, comm::ReduceOp::Sum, {Phase::Backward, "fc1"}).wait();
    });
    EXPECT_NE(msg.find("ranks disagree at all_reduce #1 (fc1, backward): rank 0 has 8,192 elements, rank 1 has 4,096"),
              std::string::npos)
        << msg;
    EXPECT_LT(seconds_since(start), 5.0);
  }, checked_world());
}

// A normal run in checked mode: FSDP training with its gather and reduce groups, which run
// ahead of each other, passes every check and trains like one process on both ranks' data.
TEST(FlightRecorderChecked, AgreeingRanksPassEveryCheck) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    torch::manual_seed(0);
    SkippingNet reference(-1);
    torch::manual_seed(0);
    auto model = FullyShardedDataParallel(SkippingNet(-1), pg, Options().auto_wrap_policy(always_wrap_policy()));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
    auto input = [](int rank, int step) { return torch::ones({4, 8}) * (0.1 * (rank + 1) + step); };
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad(/*set_to_none=*/true);
      model->forward(input(pg.rank(), step)).sum().backward();
      opt.step();
      ref_opt.zero_grad(/*set_to_none=*/true);
      ((reference->forward(input(0, step)).sum() + reference->forward(input(1, step)).sum()) / 2).backward();
      ref_opt.step();
    }
    const auto full = full_params(model);
    for (const auto& p : reference->named_parameters())
      EXPECT_LT(rel_diff(full.at(p.key()), p.value()), 1e-6) << p.key();
  }, checked_world());
}

}  // namespace
