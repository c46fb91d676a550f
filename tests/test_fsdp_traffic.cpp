// FSDP's traffic, measured where the bytes move: over the shared-memory transport,
// comm::shm_slot_counters() counts the bytes each rank copies into its ring slots
// (at the memcpy), independently of comm_counters(), which adds a formula at call
// time. One training step of an MLP with one unit per Linear (13-32-17-5: 448, 561
// and 90 parameters; the root holds none) at N = 2 and 3 (a world size that pads
// the flat buffers) is compared with what the strategy must move, computed here
// from the layer sizes alone.
//
// From slot writes to bytes delivered: an all-gather slot holds this rank's chunk
// and is read by each of the N-1 peers; a reduce-scatter slot holds the chunk of
// one peer and is read by that peer. So a rank delivers
//   all_gather * (N-1) + reduce_scatter
// bytes to its peers, to compare with the ring optimum of what the strategy moves per
// rank and step: 3Ψ(N-1)/N for FULL_SHARD (gather in forward, again in backward,
// reduce-scatter; from the second step the two units that finished forward last are
// not re-gathered, two units' gathers less) and 2Ψ(N-1)/N for SHARD_GRAD_OP; NO_SHARD's all-reduce writes every element once
// (its reduce-scatter stage the peers' chunks, its all-gather stage its own
// reduced chunk, which N-1 peers read): 2Ψ(N-1)/N delivered per rank on average over
// the ranks (derived; asserted is the Ψ each rank writes, since which chunk a rank
// reduces is the transport's split).
#include <gtest/gtest.h>

#include <set>
#include <torch/torch.h>

#include "comm/comm_testing.h"
#include "fsdp/comm/collectives.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

// Units of make_mlp() under always_wrap_policy, in forward order.
const std::vector<int64_t> kUnitNumel = {13 * 32 + 32, 32 * 17 + 17, 17 * 5 + 5};
constexpr int64_t kElem = 4;  // fp32

// Bytes of one rank's chunks of the units kept gathered from forward to backward
// ([Note: last unit stays gathered]; BACKWARD_PRE, the default, keeps two), sharded
// over g ranks.
int64_t kept_chunks(int64_t g) {
  int64_t b = 0;
  for (size_t i = kUnitNumel.size() - 2; i < kUnitNumel.size(); ++i)
    b += kElem * comm::padded_numel(kUnitNumel[i], g) / g;
  return b;
}

struct Written {
  int64_t all_gather, reduce_scatter, all_reduce, broadcast;
};

// This rank's slot writes during one training step (SGD), every rank's step complete:
// the barriers (over Gloo, not counted) make sure no write of the previous step is
// still pending and every write of this one has been read.
template <typename Model>
Written slot_bytes_of_step(Model& model, torch::optim::SGD& opt, comm::ProcessGroup& pg, int step) {
  auto [x, y] = global_batch(step, 12);
  comm::barrier(pg);
  comm::shm_slot_counters().reset();
  opt.zero_grad(/*set_to_none=*/false);
  torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()))
      .backward();
  opt.step();
  comm::barrier(pg);
  const auto& c = comm::shm_slot_counters();
  return {c.all_gather.load(), c.reduce_scatter.load(), c.all_reduce.load(), c.broadcast.load()};
}

void traffic_cases(comm::ProcessGroup& pg) {
  const int64_t n = pg.size();
  ASSERT_NE(pg.shm_channel(), nullptr) << "the test needs the shared-memory transport (one host)";
  int64_t psi = 0, psi_padded = 0;
  for (int64_t numel : kUnitNumel) {
    psi += kElem * numel;
    psi_padded += kElem * comm::padded_numel(numel, n);
  }
  // [Note: last unit stays gathered]: from the second step the last two units of the
  // forward (the first of the backward, and the one its BACKWARD_PRE prefetch gathers)
  // skip their backward gather.
  const int64_t last_chunk = kept_chunks(n);
  // Padding adds at most N-1 elements per unit to each flat buffer.
  const int64_t max_padding = kElem * (n - 1) * static_cast<int64_t>(kUnitNumel.size());
  EXPECT_LE(psi_padded - psi, max_padding);

  run_case("FULL_SHARD: 3Ψ(N-1)/N per rank, less the last two units' backward gathers", [&] {
    auto model = FullyShardedDataParallel(make_mlp(), pg, Options().sharding_strategy(ShardingStrategy::kFullShard)
                                                              .auto_wrap_policy(always_wrap_policy()));
    torch::optim::SGD opt(model->parameters(), 0.05);
    // First step: no forward order recorded yet, so every unit is re-gathered in
    // backward ([Note: last unit stays gathered] in src/core/runtime.h).
    const Written first = slot_bytes_of_step(model, opt, pg, 0);
    EXPECT_EQ(first.all_gather, 2 * psi_padded / n);
    EXPECT_EQ(first.reduce_scatter, psi_padded * (n - 1) / n);
    EXPECT_EQ(first.all_reduce, 0);
    EXPECT_EQ(first.broadcast, 0);
    const int64_t ring_optimum = 3 * psi * (n - 1) / n;
    EXPECT_EQ(first.all_gather * (n - 1) + first.reduce_scatter, 3 * psi_padded * (n - 1) / n);
    EXPECT_LE(first.all_gather * (n - 1) + first.reduce_scatter - ring_optimum, 3 * max_padding * (n - 1) / n);
    // Later steps: the two units that finished forward last stay gathered for backward.
    for (int step = 1; step < 3; ++step) {
      const Written w = slot_bytes_of_step(model, opt, pg, step);
      EXPECT_EQ(w.all_gather, 2 * psi_padded / n - last_chunk) << "step " << step;
      EXPECT_EQ(w.reduce_scatter, psi_padded * (n - 1) / n) << "step " << step;
      EXPECT_EQ(w.all_reduce, 0);
      const int64_t delivered = w.all_gather * (n - 1) + w.reduce_scatter;
      EXPECT_EQ(delivered, 3 * psi_padded * (n - 1) / n - last_chunk * (n - 1)) << "step " << step;
      EXPECT_GE(delivered, ring_optimum - last_chunk * (n - 1));
      EXPECT_LE(delivered, ring_optimum + 3 * max_padding * (n - 1) / n);
    }
  });

  run_case("SHARD_GRAD_OP: 2Ψ(N-1)/N per rank", [&] {
    auto model = FullyShardedDataParallel(make_mlp(), pg, Options().sharding_strategy(ShardingStrategy::kShardGradOp)
                                                              .auto_wrap_policy(always_wrap_policy()));
    torch::optim::SGD opt(model->parameters(), 0.05);
    for (int step = 0; step < 2; ++step) {
      const Written w = slot_bytes_of_step(model, opt, pg, step);
      EXPECT_EQ(w.all_gather, psi_padded / n) << "step " << step;
      EXPECT_EQ(w.reduce_scatter, psi_padded * (n - 1) / n) << "step " << step;
      EXPECT_EQ(w.all_reduce, 0);
      const int64_t delivered = w.all_gather * (n - 1) + w.reduce_scatter;
      EXPECT_EQ(delivered, 2 * psi_padded * (n - 1) / n);
      EXPECT_GE(delivered, 2 * psi * (n - 1) / n);
      EXPECT_LE(delivered, 2 * psi * (n - 1) / n + 2 * max_padding * (n - 1) / n);
    }
  });

  run_case("NO_SHARD: every gradient element written once per rank", [&] {
    auto model = FullyShardedDataParallel(make_mlp(), pg, Options().sharding_strategy(ShardingStrategy::kNoShard)
                                                              .auto_wrap_policy(always_wrap_policy()));
    torch::optim::SGD opt(model->parameters(), 0.05);
    for (int step = 0; step < 2; ++step) {
      const Written w = slot_bytes_of_step(model, opt, pg, step);
      EXPECT_EQ(w.all_gather, 0) << "step " << step;
      EXPECT_EQ(w.reduce_scatter, 0) << "step " << step;
      EXPECT_EQ(w.all_reduce, psi) << "step " << step;  // no padding without sharding
    }
  });

  run_case("mixed units: only the trainable parameters' padded bytes are reduced and held", [&] {
    // Every Linear's weight frozen, its bias trainable: each unit is a trainable unit and a
    // frozen companion ([Note: frozen companions] in src/core/runtime.h).
    auto mlp = make_mlp();
    for (size_t i = 0; i < mlp->size(); i += 2) mlp[i]->named_parameters()["weight"].requires_grad_(false);
    auto model = FullyShardedDataParallel(mlp, pg, Options().sharding_strategy(ShardingStrategy::kFullShard)
                                                       .auto_wrap_policy(always_wrap_policy()));
    EXPECT_EQ(model->unit_paths(),
              (std::vector<std::string>{"0", "0 (frozen)", "2", "2 (frozen)", "4", "4 (frozen)"}));
    const std::vector<int64_t> bias = {32, 17, 5}, weight = {13 * 32, 32 * 17, 17 * 5};
    int64_t bias_padded = 0, all_padded = 0;
    for (size_t u = 0; u < bias.size(); ++u) {
      bias_padded += kElem * comm::padded_numel(bias[u], n);
      all_padded += kElem * (comm::padded_numel(bias[u], n) + comm::padded_numel(weight[u], n));
    }
    torch::optim::SGD opt(model->parameters(), 0.05);
    const Written w = slot_bytes_of_step(model, opt, pg, 0);
    EXPECT_EQ(w.reduce_scatter, bias_padded * (n - 1) / n) << "the frozen weights must not be reduced";
    EXPECT_EQ(w.all_gather, 2 * all_padded / n) << "both segments gathered in forward and again in backward";
    // The gradients held: the biases' reduced chunks, no byte for a weight.
    std::set<const void*> storages;
    int64_t held = 0;
    for (const auto& p : model->named_parameters()) {
      if (!p.value().requires_grad()) {
        EXPECT_FALSE(p.value().grad().defined()) << p.key();
        continue;
      }
      const auto& g = p.value().grad();
      if (g.defined() && storages.insert(g.storage().data()).second) held += int64_t(g.storage().nbytes());
    }
    EXPECT_EQ(held, bias_padded / n);
  });

  run_case("over Gloo nothing goes through the slots", [&] {
    // The counters measure the shared-memory transport only; TCP traffic is not counted here.
    comm::set_comm_shared_memory(false);
    auto model = FullyShardedDataParallel(make_mlp(), pg, Options().auto_wrap_policy(always_wrap_policy()));
    torch::optim::SGD opt(model->parameters(), 0.05);
    const Written w = slot_bytes_of_step(model, opt, pg, 0);
    comm::set_comm_shared_memory(true);
    EXPECT_EQ(w.all_gather + w.reduce_scatter + w.all_reduce + w.broadcast, 0);
  });
}

// HYBRID_SHARD at N=4, shard groups of g=2, R=2 replicas: FULL_SHARD inside the
// shard group (3Ψ(g-1)/g) plus the all-reduce of the reduced shard across replicas
// (2(Ψ/g)(R-1)/R). At R=2 every all-reduce slot is read by the one other replica,
// so the bytes written are the bytes delivered.
void hybrid_traffic_case(comm::ProcessGroup& pg) {
  ASSERT_EQ(pg.size(), 4);
  const int64_t g = 2, replicas = 2;
  int64_t psi = 0, psi_padded = 0;
  for (int64_t numel : kUnitNumel) {
    psi += kElem * numel;
    psi_padded += kElem * comm::padded_numel(numel, g);
  }
  const int64_t last_chunk = kept_chunks(g);
  run_case("HYBRID_SHARD g=2: 3Ψ(g-1)/g in the shard group + 2(Ψ/g)(R-1)/R across replicas", [&] {
    auto model = FullyShardedDataParallel(make_mlp(), pg, Options().sharding_strategy(ShardingStrategy::kHybridShard)
                                                              .shard_group_size(g)
                                                              .auto_wrap_policy(always_wrap_policy()));
    torch::optim::SGD opt(model->parameters(), 0.05);
    for (int step = 0; step < 2; ++step) {
      const Written w = slot_bytes_of_step(model, opt, pg, step);
      const int64_t kept = step == 0 ? 0 : last_chunk;  // [Note: last unit stays gathered]
      EXPECT_EQ(w.all_gather, 2 * psi_padded / g - kept) << "step " << step;
      EXPECT_EQ(w.reduce_scatter, psi_padded * (g - 1) / g) << "step " << step;
      EXPECT_EQ(w.all_reduce, psi_padded / g) << "step " << step;
      const int64_t delivered = w.all_gather * (g - 1) + w.reduce_scatter + w.all_reduce;
      EXPECT_EQ(delivered, 3 * psi_padded * (g - 1) / g + 2 * (psi_padded / g) * (replicas - 1) / replicas -
                               kept * (g - 1));
      // Padding (at most g-1 elements per unit) is the only excess over the unpadded volume.
      const int64_t max_padding = kElem * (g - 1) * static_cast<int64_t>(kUnitNumel.size());
      EXPECT_LE(delivered - (3 * psi * (g - 1) / g + 2 * (psi / g) * (replicas - 1) / replicas),
                3 * max_padding * (g - 1) / g + max_padding / g);
    }
  });
}

}  // namespace

TEST(FsdpTraffic, SlotBytesOfOneStepMatchTheRingOptimum) {
  for (int n = 2; n <= 3; ++n) run_ranks(n, traffic_cases);
}

TEST(FsdpTraffic, HybridShardSlotBytes) { run_ranks(4, hybrid_traffic_case); }
