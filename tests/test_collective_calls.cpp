// Every collective of the library passes one function (src/comm/collective_call.h) that
// knows the group, op, dtype, size and the caller's label. An observer there sees a whole
// FSDP training step, clipping, a state dict and construction at N=2: each call labelled
// with its phase and unit, its sizes those of the units' flat buffers, and the bytes the
// observer adds up equal to the byte counters that the same function keeps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "comm/collective_call.h"
#include "fsdp/comm/call_label.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/state_dict.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;
using comm::Phase;
using comm::detail::CollectiveOp;

namespace {

struct Seen {
  CollectiveOp op;
  at::ScalarType dtype;
  int64_t numel;
  Phase phase;
  std::string subject;
};

// Records every call issued while it lives.
class Recorder {
 public:
  Recorder() {
    id_ = comm::detail::add_collective_observer([this](const comm::ProcessGroup&, const comm::detail::CollectiveCall& c) {
      std::lock_guard<std::mutex> lock(mu_);
      seen_.push_back({c.op, c.dtype(), c.numel(), c.label.phase, c.label.subject});
    });
  }
  ~Recorder() { comm::detail::remove_collective_observer(id_); }
  std::vector<Seen> take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(seen_, {});
  }

 private:
  int id_;
  std::mutex mu_;
  std::vector<Seen> seen_;
};

// Units of make_mlp() under always_wrap_policy: one per Linear ("0", "2", "4"), in
// forward order; the root holds no parameters of its own.
const std::vector<std::pair<std::string, int64_t>> kUnits = {{"0", 13 * 32 + 32}, {"2", 32 * 17 + 17}, {"4", 17 * 5 + 5}};

void labelled_calls(comm::ProcessGroup& pg) {
  const int64_t n = pg.size();
  std::map<std::string, int64_t> padded;
  for (const auto& [path, numel] : kUnits) padded[path] = comm::padded_numel(numel, n);

  Recorder rec;
  auto model = FullyShardedDataParallel(make_mlp(), pg, Options().sharding_strategy(ShardingStrategy::kFullShard)
                                                            .auto_wrap_policy(always_wrap_policy()));
  run_case("construction is labelled setup", [&] {
    const auto calls = rec.take();
    ASSERT_FALSE(calls.empty());
    for (const auto& c : calls) EXPECT_EQ(c.phase, Phase::kSetup) << comm::detail::to_string(c.op);
  });

  torch::optim::SGD opt(model->parameters(), 0.05);
  auto [x, y] = global_batch(0, 12);
  const int64_t gathered_before = comm::comm_counters().all_gather;
  const int64_t reduced_before = comm::comm_counters().reduce_scatter;
  auto out = model->forward(rank_slice(x, pg.rank(), n));
  const auto forward = rec.take();
  torch::mse_loss(out, rank_slice(y, pg.rank(), n)).backward();
  const auto backward = rec.take();

  run_case("forward: one all-gather per unit, in forward order, of its padded flat buffer", [&] {
    ASSERT_EQ(forward.size(), kUnits.size());
    for (size_t i = 0; i < kUnits.size(); ++i) {
      EXPECT_EQ(forward[i].op, CollectiveOp::kAllGather);
      EXPECT_EQ(forward[i].phase, Phase::kForward);
      EXPECT_EQ(forward[i].subject, kUnits[i].first);
      EXPECT_EQ(forward[i].numel, padded[kUnits[i].first]);
      EXPECT_EQ(forward[i].dtype, at::kFloat);
    }
  });

  run_case("backward: every unit re-gathered and reduce-scattered once, labelled backward", [&] {
    std::multiset<std::string> gathered, reduced;
    int64_t gathered_bytes = 0, reduced_bytes = 0;
    for (const auto& c : backward) {
      EXPECT_EQ(c.phase, Phase::kBackward) << comm::detail::to_string(c.op) << " " << c.subject;
      if (c.op == CollectiveOp::kAllGather) {
        gathered.insert(c.subject);
        gathered_bytes += c.numel * 4 / n * (n - 1);
      } else if (c.op == CollectiveOp::kReduceScatter) {
        reduced.insert(c.subject);
        reduced_bytes += c.numel * 4 / n * (n - 1);
        EXPECT_EQ(c.numel, padded[c.subject]) << c.subject;
      } else {
        ADD_FAILURE() << "unexpected " << comm::detail::to_string(c.op) << " in backward";
      }
    }
    // First step: no forward order recorded yet, so every unit is gathered again.
    EXPECT_EQ(gathered, (std::multiset<std::string>{"0", "2", "4"}));
    EXPECT_EQ(reduced, (std::multiset<std::string>{"0", "2", "4"}));
    int64_t forward_bytes = 0;
    for (const auto& c : forward) forward_bytes += c.numel * 4 / n * (n - 1);
    // The observer and the byte counters are fed by the same function.
    EXPECT_EQ(comm::comm_counters().all_gather - gathered_before, forward_bytes + gathered_bytes);
    EXPECT_EQ(comm::comm_counters().reduce_scatter - reduced_before, reduced_bytes);
  });

  run_case("clipping and the optimizer step", [&] {
    model->clip_grad_norm_(1.0);
    opt.step();
    const auto calls = rec.take();
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0].op, CollectiveOp::kAllReduce);
    EXPECT_EQ(calls[0].phase, Phase::kStep);
    EXPECT_EQ(calls[0].subject, "clip_grad_norm_");
    EXPECT_EQ(calls[0].dtype, at::kDouble);
  });

  run_case("a full state dict gathers each unit, labelled state_dict", [&] {
    (void)fsdp::state_dict(*model);  // FULL by default
    const auto calls = rec.take();
    std::set<std::string> units;
    for (const auto& c : calls) {
      EXPECT_EQ(c.phase, Phase::kStateDict) << comm::detail::to_string(c.op) << " " << c.subject;
      if (c.op == CollectiveOp::kAllGather) units.insert(c.subject);
    }
    EXPECT_EQ(units, (std::set<std::string>{"0", "2", "4"}));
  });

  run_case("an explicit label wins over the scope; a scope labels the rest", [&] {
    auto t = torch::ones({3});
    {
      comm::LabelScope scope({Phase::kTrainer, "outer"});
      comm::all_reduce(pg, t).wait();
      comm::all_reduce(pg, t, comm::ReduceOp::kSum, {Phase::kStep, "mine"}).wait();
      {
        comm::LabelScope inner({Phase::kCheckpoint, "inner"});
        comm::barrier(pg);
      }
      comm::broadcast(pg, t, 0).wait();
    }
    comm::all_reduce(pg, t).wait();
    const auto calls = rec.take();
    ASSERT_EQ(calls.size(), 5u);
    EXPECT_EQ(calls[0].subject, "outer");
    EXPECT_EQ(calls[1].subject, "mine");
    EXPECT_EQ(calls[1].phase, Phase::kStep);
    EXPECT_EQ(calls[2].op, CollectiveOp::kBarrier);
    EXPECT_EQ(calls[2].subject, "inner");
    EXPECT_EQ(calls[3].subject, "outer");
    EXPECT_EQ(calls[4].phase, Phase::kUnlabelled);
    EXPECT_EQ(calls[4].numel, 3);
  });

  run_case("a tensor off the CPU is refused before anything moves, naming the call", [&] {
    // The meta device stands in for CUDA here: any device but the CPU is refused alike.
    auto t = torch::empty({4}, torch::TensorOptions().device(torch::kMeta));
    try {
      comm::all_reduce(pg, t, comm::ReduceOp::kSum, {Phase::kBackward, "blocks.1"}).wait();
      ADD_FAILURE() << "a meta tensor was accepted";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      for (const char* part : {"all_reduce", "group 'world'", "backward blocks.1", "rank", "meta", "CPU and CUDA tensors only"})
        EXPECT_NE(msg.find(part), std::string::npos) << part << " missing in: " << msg;
    }
    EXPECT_TRUE(rec.take().empty()) << "a refused call reached the observers";
  });
}

}  // namespace

TEST(CollectiveCalls, EveryCallOfAStepIsLabelledN2) { run_ranks(2, labelled_calls); }

TEST(CollectiveCalls, LabelsDescribeThemselves) {
  EXPECT_EQ(comm::CallLabel().describe(), "unlabelled");
  EXPECT_EQ(comm::CallLabel(Phase::kForward, "blocks.3").describe(), "forward blocks.3");
  EXPECT_TRUE(comm::scope_label().empty());
  {
    comm::LabelScope a(comm::CallLabel(Phase::kStep));
    EXPECT_EQ(comm::scope_label().describe(), "step");
  }
  EXPECT_TRUE(comm::scope_label().empty());
}
