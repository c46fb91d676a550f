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
//  - The faults of a training loop on both transports, unchecked and checked (PlantedFault):
//    a rank that skips one unit's forward, a rank whose model has another width (FSDP
//    refuses it at construction), a rank that takes a state dict while the other steps, a
//    rank that takes an extra micro-batch (checked: named by the wait across groups,
//    [Note: waits across groups] in collective_check.h).
//  - A wider model under ZeRO, whose construction broadcast passes unchecked with the sizes
//    differing (broadcasts go through Gloo on both transports) and is named at the first step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <regex>
#include <thread>

#include "comm/divergence.h"
#include "comm/flight_recorder.h"
#include "fsdp/comm/call_label.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/state_dict.h"
#include "harness/error_of.h"
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
               RecordState state = RecordState::kCompleted) {
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
  auto common = rec(56, "all_gather", 8192, Phase::kForward, "blocks.2");
  std::vector<RankRecords> ranks;
  for (int r = 0; r < 4; ++r) {
    auto at57 = r == 1 ? rec(57, "all_gather", 8192, Phase::kForward, "blocks.3", RecordState::kFailed)
                       : rec(57, "reduce_scatter", 8192, Phase::kBackward, "blocks.2", RecordState::kFailed);
    ranks.push_back(rank_of(r, {common, at57}));
  }
  EXPECT_EQ(describe_divergence("world", ranks),
            "rank 1 is at all_gather #57 (blocks.3, forward) while ranks 0, 2, 3 are at reduce_scatter #57 "
            "(blocks.2, backward)");
}

TEST(FlightRecorderText, SizeMismatchNamesBothSizes) {
  std::vector<RankRecords> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.push_back(rank_of(r, {rec(12, "all_gather", r == 2 ? 4096 : 8192, Phase::kForward, "fc1",
                                    RecordState::kFailed)}));
  EXPECT_EQ(describe_divergence("world", ranks),
            "ranks disagree at all_gather #12 (fc1, forward): rank 2 has 4,096 elements, the others 8,192");
}

TEST(FlightRecorderText, RankBehindIsNamedWithItsLastCall) {
  auto first = rec(4, "broadcast", 10, Phase::kSetup, "");
  std::vector<RankRecords> ranks = {
      rank_of(0, {first, rec(5, "all_reduce", 1, Phase::kStep, "", RecordState::kFailed)}),
      rank_of(1, {first}),
  };
  EXPECT_EQ(describe_divergence("world", ranks),
            "rank 0 is at all_reduce #5 (step) while rank 1 has not issued #5 on group 'world'; rank 1's last "
            "is broadcast #4 (setup), completed");
}

TEST(FlightRecorderText, SilentRankIsNamedWhileTheOthersWait) {
  std::vector<RankRecords> ranks = {rank_of(0, {rec(1, "all_reduce", 4, Phase::kStep, "", RecordState::kFailed)}),
                                    {1, false, {}}};
  EXPECT_EQ(describe_divergence("world", ranks),
            "rank 1 did not answer: not in a collective of group 'world' (stuck elsewhere, or gone), while rank 0 "
            "waits at all_reduce #1 (step)");
}

TEST(FlightRecorderText, AgreeingRanksRunningAheadAreNoDivergence) {
  // Rank 1 is one collective ahead, but the ones both issued match and none is stuck.
  auto a = rec(1, "all_gather", 64, Phase::kForward, "fc1");
  auto b = rec(2, "all_gather", 64, Phase::kForward, "fc2");
  std::vector<RankRecords> ranks = {rank_of(0, {a}), rank_of(1, {a, b})};
  EXPECT_EQ(describe_divergence("world", ranks), "");
}

TEST(FlightRecorderText, RecordsSurviveTheirTextForm) {
  auto r = rec(7, "reduce_scatter", 123456, Phase::kBackward, "blocks.0.attn", RecordState::kIssued);
  r.site = "src/core/unit.cpp:120";
  auto back = comm::detail::decode_records(comm::detail::encode_records({r, rec(8, "barrier", 0, Phase::kSetup, "")}));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_TRUE(back[0].same_call(r));
  EXPECT_EQ(back[0].seq, 7u);
  EXPECT_EQ(back[0].site, r.site);
  EXPECT_EQ(back[0].state, RecordState::kIssued);
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
// What the planted fault throws, each line ended by a newline (so a test can match a whole
// line, the last one too); a fault that does not fail is a failure of the test.
std::string fault_error(const std::function<void()>& body) {
  std::string msg = error_of(body);
  if (msg.empty()) ADD_FAILURE() << "the planted fault did not fail";
  if (!msg.empty() && msg.back() != '\n') msg += '\n';
  return msg;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

TEST(FlightRecorderFaults, RankThatSkipsACollectiveIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto t = torch::ones({16});
    comm::all_reduce(pg, t, comm::ReduceOp::kSum, {Phase::kSetup, "warm-up"}).wait();
    const auto start = Clock::now();
    const std::string msg = fault_error([&] {
      if (pg.rank() == 0) {
        auto flat = torch::zeros({32});
        comm::all_gather_into(pg, flat, torch::ones({16}), {Phase::kForward, "blocks.3"}).wait();
      }
      comm::all_reduce(pg, t, comm::ReduceOp::kSum, {Phase::kStep, "loss"}).wait();
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
    const std::string msg = fault_error([&] {
      auto t = torch::ones({n});
      comm::all_reduce(pg, t, comm::ReduceOp::kSum, {Phase::kBackward, "fc1"}).wait();
      // A transport that let the mismatch pass would meet the next collective here.
      comm::all_reduce(pg, t, comm::ReduceOp::kSum, {Phase::kStep, "after"}).wait();
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

// ---- a rank that skips one unit's forward ----

// Three units of the same size: a rank that skips blocks1 gathers blocks2 where the others
// gather blocks1, which no transport can tell apart by size.
// `width`: the features between the blocks (8 in and out either way).
struct SkippingNetImpl : torch::nn::Module {
  explicit SkippingNetImpl(int skip, int width = 8) : skip(skip) {
    for (int i = 0; i < 3; ++i)
      blocks.push_back(register_module("blocks" + std::to_string(i),
                                       fsdp::Wrappable<torch::nn::LinearImpl>(i == 0 ? 8 : width, i == 2 ? 8 : width)));
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

// ---- the checked mode ----

RankOptions checked_world() {
  RankOptions o = faulty_world();
  o.collective_timeout = std::chrono::milliseconds(30000);  // the check must not wait for it
  o.extra_env.push_back("FSDP_CHECK_COLLECTIVES=1");
  return o;
}

// Over Gloo an unchecked size mismatch aborts the receiving rank inside Gloo; checked, both
// ranks fail before anything moves.
TEST(FlightRecorderChecked, SizeMismatchOverGlooFailsAtOnceOnEveryRank) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const int64_t n = pg.rank() == 1 ? 4096 : 8192;
    const auto start = Clock::now();
    const std::string msg = fault_error([&] {
      auto t = torch::ones({n});
      comm::all_reduce(pg, t, comm::ReduceOp::kSum, {Phase::kBackward, "fc1"}).wait();
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


// ---- the matrix: faults of a training loop, on both transports, unchecked and checked ----
//
// Each fault runs on the shared-memory transport and on Gloo, without and with the checked
// mode. Unchecked, the ranks wait until the 3 s timeout (or until a slot header disagrees) and
// every rank's error names the first divergence within the timeout + 5 s; checked, every rank
// fails in under 5 s, with a 30 s timeout that a check waiting for it would overrun.

struct Setting {
  bool gloo;
  bool checked;
};

class PlantedFault : public ::testing::TestWithParam<Setting> {
 protected:
  static RankOptions world() {
    RankOptions o = GetParam().checked ? checked_world() : faulty_world();
    if (!GetParam().gloo)
      o.extra_env.erase(std::remove(o.extra_env.begin(), o.extra_env.end(), "FSDP_SHARED_MEMORY=0"), o.extra_env.end());
    return o;
  }
  static double limit_s() { return GetParam().checked ? 5.0 : 3.0 + 5.0; }
  static void expect_transport(const comm::ProcessGroup& pg) {
    EXPECT_EQ(pg.checks_collectives(), GetParam().checked);
    EXPECT_EQ(pg.shm_channel() != nullptr, !GetParam().gloo);
  }
};

// A small FSDP training loop as a trainer runs it: SGD on SkippingNet's three units, and the
// step's loss summed over the ranks on the world group.
struct Trainee {
  explicit Trainee(comm::ProcessGroup& pg, int width = 8)
      : pg(pg),
        model(SkippingNet(-1, width), pg, Options().auto_wrap_policy(always_wrap_policy())),
        opt(model->parameters(), torch::optim::SGDOptions(0.1)) {}
  void step(int micro_batches = 1) {
    opt.zero_grad(/*set_to_none=*/true);
    auto loss = torch::zeros({});
    for (int m = 0; m < micro_batches; ++m) {
      auto l = model->forward(torch::ones({4, 8})).sum();
      l.backward();
      loss += l.detach();
    }
    opt.step();
    comm::all_reduce(pg, loss, comm::ReduceOp::kSum, {Phase::kStep, "loss"}).wait();
  }
  comm::ProcessGroup& pg;
  FullyShardedDataParallel<SkippingNetImpl> model;
  torch::optim::SGD opt;
};

// Where this rank's next collective on a group goes: the group's name and the number after
// its last record. `op`: the group whose last record is of that op; "" for the world group.
struct NextCall {
  std::string group;
  uint64_t seq = 0;
};
NextCall next_call(const comm::ProcessGroup& pg, const std::string& op) {
  for (const auto& g : comm::detail::live_recorders(pg.store().get())) {
    auto rec = g.recorder.lock();
    if (!rec) continue;
    const auto records = rec->recent();
    const bool match = op.empty() ? g.group == pg.name() : !records.empty() && records.back().op == op;
    if (match) return {g.group, records.empty() ? 1 : records.back().seq + 1};
  }
  ADD_FAILURE() << "no group of this world has issued " << (op.empty() ? "anything" : op);
  return {};
}

// "all_gather #7 (blocks0, forward) at src/core/unit.cpp:N": a record as the texts describe
// it, with the line of its site left out (see without_lines).
std::string at_call(const char* op, uint64_t seq, const std::string& label, const std::string& file) {
  return std::string(op) + " #" + std::to_string(seq) + " (" + label + ") at " + file + ":N";
}
// `text` with every "file.cpp:123" as "file.cpp:N": the sites' lines are not the facts tested.
std::string without_lines(const std::string& text) {
  return std::regex_replace(text, std::regex("\\.cpp:[0-9]+"), ".cpp:N");
}
// How each mode heads a divergence on `group`: the failure exchange's line for this rank, or
// the check's error.
std::string divergence_head(const comm::ProcessGroup& pg, const std::string& group, bool checked) {
  const std::string r = std::to_string(pg.rank());
  return checked ? "fsdp: collective check (FSDP_CHECK_COLLECTIVES) on group '" + group + "', rank " + r + ": "
                 : "collective record (rank " + r + "): on group '" + group + "': ";
}

INSTANTIATE_TEST_SUITE_P(Matrix, PlantedFault,
                         ::testing::Values(Setting{false, false}, Setting{true, false}, Setting{false, true},
                                           Setting{true, true}),
                         [](const ::testing::TestParamInfo<Setting>& i) {
                           return std::string(i.param.gloo ? "Gloo" : "SharedMemory") +
                                  (i.param.checked ? "Checked" : "Unchecked");
                         });

// After a step together, rank 1 skips blocks1's forward: where rank 0 gathers blocks1, it
// gathers blocks2, of the same size, which no transport can tell apart; the records can.
TEST_P(PlantedFault, RankThatSkipsAUnitsForwardIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    expect_transport(pg);
    Trainee t(pg);
    t.step();
    const NextCall gather = next_call(pg, "all_gather");  // blocks0's, then the divergence
    if (pg.rank() == 1) std::dynamic_pointer_cast<SkippingNetImpl>(t.model->module_ptr())->skip = 1;
    const auto start = Clock::now();
    const std::string msg = without_lines(fault_error([&] { t.step(); }));
    EXPECT_NE(msg.find(divergence_head(pg, gather.group, GetParam().checked) + "rank 0 is at " +
                       at_call("all_gather", gather.seq + 1, "blocks1, forward", "src/core/unit.cpp") +
                       " while rank 1 is at " + at_call("all_gather", gather.seq + 1, "blocks2, forward", "src/core/unit.cpp") +
                       "\n"),
              std::string::npos)
        << msg;
    EXPECT_LT(seconds_since(start), limit_s());
  }, world());
}

// A rank stuck outside any collective (a sleep past the peer's timeout and its exchange)
// is named as not arriving, on either transport, checked or not: nothing diverges before
// the timeout, so the checked mode too waits for it, with the same 3 s.
TEST_P(PlantedFault, RankStuckOutsideACollectiveIsNamedAsNotArriving) {
  RankOptions o = world();
  o.collective_timeout = std::chrono::milliseconds(3000);
  run_ranks(2, [](comm::ProcessGroup& pg) {
    expect_transport(pg);
    auto t = torch::ones({16});
    if (pg.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(7));  // then gone without a word
      return;
    }
    const auto start = Clock::now();
    const std::string msg = fault_error([&] { comm::all_reduce(pg, t, comm::ReduceOp::kSum, {Phase::kStep, "loss"}).wait(); });
    EXPECT_NE(msg.find("rank 1 did not answer: not in a collective of group 'world'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("while rank 0 waits at all_reduce #1 (loss, step)"), std::string::npos) << msg;
    EXPECT_LT(seconds_since(start), 3.0 + 5.0);
  }, o);
}

// FSDP compares every rank's parameter list with rank 0's at construction, so a rank whose
// model has another width fails there, on every rank and before any collective of training,
// naming the parameter and both shapes; the checked mode finds nothing earlier (the
// comparison's own collectives agree).
TEST_P(PlantedFault, RankWithAnotherWidthIsNamedAtConstruction) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    expect_transport(pg);
    const auto start = Clock::now();
    const std::string msg = fault_error([&] { Trainee(pg, pg.rank() == 1 ? 16 : 8).step(); });
    EXPECT_NE(msg.find("fsdp: the model differs across ranks (seen on rank " + std::to_string(pg.rank()) +
                       "): rank 1 differs from rank 0 at parameter #0: rank 0 has 'blocks0.weight [8, 8] Float cpu'"),
              std::string::npos)
        << msg;
    EXPECT_EQ(msg.find(", this rank has 'blocks0.weight [16, 8] Float cpu'") != std::string::npos, pg.rank() == 1) << msg;
    EXPECT_LT(seconds_since(start), limit_s());
  }, world());
}

// After a step together, rank 1 takes a FULL state dict (a gather per unit, in unit order)
// while rank 0 goes on training. The gathers have the same size and op as the forward's, so
// no transport can tell them apart; the records can, by their label.
TEST_P(PlantedFault, RankThatTakesAStateDictWhileTheOthersStepIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    expect_transport(pg);
    Trainee t(pg);
    t.step();
    const NextCall gather = next_call(pg, "all_gather");
    const auto start = Clock::now();
    const std::string msg = without_lines(fault_error([&] {
      if (pg.rank() == 1) fsdp::state_dict(*t.model);
      t.step();
    }));
    EXPECT_NE(msg.find(divergence_head(pg, gather.group, GetParam().checked) + "rank 0 is at " +
                       at_call("all_gather", gather.seq, "blocks0, forward", "src/core/unit.cpp") + " while rank 1 is at " +
                       at_call("all_gather", gather.seq, "blocks0, state_dict", "src/core/state_view.cpp") + "\n"),
              std::string::npos)
        << msg;
    EXPECT_LT(seconds_since(start), limit_s());
  }, world());
}

// After two steps together, rank 1 accumulates two micro-batches where rank 0 takes one. Its
// first micro-batch issues what rank 0's step does; its second forward gathers what rank 0
// never gathers in this step, while rank 0 sums the loss on the world group.
TEST_P(PlantedFault, RankThatTakesAnExtraMicroBatchIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    expect_transport(pg);
    Trainee t(pg);
    t.step();
    const uint64_t gathers_before = next_call(pg, "all_gather").seq;
    t.step();
    const NextCall loss = next_call(pg, "");
    NextCall gather = next_call(pg, "all_gather");
    // Rank 1's first micro-batch pairs with rank 0's step; its second starts a step later.
    gather.seq += gather.seq - gathers_before;
    const auto start = Clock::now();
    const std::string msg = without_lines(fault_error([&] { t.step(pg.rank() == 1 ? 2 : 1); }));
    const std::string rank0_at = at_call("all_reduce", loss.seq, "loss, step", "tests/test_flight_recorder.cpp");
    const std::string rank1_at = at_call("all_gather", gather.seq, "blocks0, forward", "src/core/unit.cpp");
    if (GetParam().checked) {
      // Each waits in the check of another group: named by the wait across groups.
      const std::string mine = pg.rank() == 0 ? rank0_at : rank1_at, theirs = pg.rank() == 0 ? rank1_at : rank0_at;
      const std::string my_group = pg.rank() == 0 ? loss.group : gather.group;
      const std::string their_group = pg.rank() == 0 ? gather.group : loss.group;
      const std::string me = std::to_string(pg.rank()), peer = std::to_string(1 - pg.rank());
      EXPECT_NE(msg.find(divergence_head(pg, my_group, true) + "rank " + me + " is at " + mine + " on group '" +
                         my_group + "' while rank " + peer + " is at " + theirs + " on group '" + their_group +
                         "', which rank " + me + " has not issued: each waits for the other"),
                std::string::npos)
          << msg;
    } else {
      // The extra forward matches no gather of rank 0; rank 0's loss no all-reduce of rank 1.
      EXPECT_NE(msg.find(divergence_head(pg, loss.group, false) + "rank 0 is at " + rank0_at + " while rank 1 has not issued #" +
                         std::to_string(loss.seq) + " on group '" + loss.group + "'; rank 1's last is " +
                         at_call("all_reduce", loss.seq - 1, "loss, step", "tests/test_flight_recorder.cpp") +
                         ", completed"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find(divergence_head(pg, gather.group, false) + "rank 1 is at " + rank1_at +
                         " while rank 0 has not issued #" + std::to_string(gather.seq) + " on group '" + gather.group +
                         "'; rank 0's last is " +
                         at_call("all_gather", gather.seq - 1, "blocks0, backward", "src/core/unit.cpp") + ", completed"),
                std::string::npos)
          << msg;
    }
    EXPECT_LT(seconds_since(start), limit_s());
  }, world());
}

// ZeRO compares the trainable parameters across ranks at construction, as FSDP does, before
// rank 0's values are broadcast into them (a broadcast over Gloo would take rank 0's shorter
// message into rank 1's longer buffer without a word).
optim::ZeroRedundancyOptimizer zero_of(SkippingNet& net, comm::ProcessGroup& pg) {
  return optim::ZeroRedundancyOptimizer(net->parameters(),
                                        optim::inner_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
                                        optim::ZeroOptions().process_group(pg));
}

// Every rank refuses, naming rank 1's first differing parameter (in ZeRO's flat order) and both
// shapes, whether checked or not.
void zero_with_wider_rank1_is_refused(comm::ProcessGroup& pg) {
  const auto start = Clock::now();
  const std::string msg = fault_error([&] {
    SkippingNet net(-1, pg.rank() == 1 ? 16 : 8);
    zero_of(net, pg);
  });
  const std::string expected = "ZeroRedundancyOptimizer: the trainable parameters differ across ranks (seen on rank " +
                               std::to_string(pg.rank()) +
                               "): rank 1 differs from rank 0 at parameter #1: rank 0 has 'param_groups[0][4] [8, 8] Float cpu in group 0'";
  EXPECT_NE(msg.find(expected), std::string::npos) << msg;
  if (pg.rank() == 1) {
    EXPECT_NE(msg.find("this rank has 'param_groups[0][4] [8, 16] Float cpu in group 0'"), std::string::npos) << msg;
  }
  EXPECT_NE(msg.find("Build the same model and parameter groups on every rank"), std::string::npos) << msg;
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST(FlightRecorderFaults, WiderModelUnderZeroIsRefusedAtConstruction) {
  RankOptions o = faulty_world();
  o.extra_env.clear();
  run_ranks(2, [](comm::ProcessGroup& pg) {
    ASSERT_NE(pg.shm_channel(), nullptr) << "the shared-memory transport is not in use";
    zero_with_wider_rank1_is_refused(pg);
  }, o);
}

TEST(FlightRecorderChecked, WiderModelUnderZeroIsRefusedAtConstructionOnSharedMemory) {
  RankOptions o = checked_world();
  o.extra_env = {"FSDP_CHECK_COLLECTIVES=1"};
  run_ranks(2, [](comm::ProcessGroup& pg) {
    ASSERT_NE(pg.shm_channel(), nullptr) << "the shared-memory transport is not in use";
    zero_with_wider_rank1_is_refused(pg);
  }, o);
}

TEST(FlightRecorderChecked, WiderModelUnderZeroIsRefusedAtConstructionOverGloo) {
  run_ranks(2, [](comm::ProcessGroup& pg) { zero_with_wider_rank1_is_refused(pg); }, checked_world());
}

}  // namespace
