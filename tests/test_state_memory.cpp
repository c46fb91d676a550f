// Memory of state dicts and checkpoints, counted by a wrapping CPU allocator
// (every CPU tensor allocation goes through it), at N=3, over both transports:
//  - after a training step a rank holds exactly its parameter shards, gradient
//    storage, optimizer state and the buffer pool's idle blocks: nothing else is
//    left behind by the step;
//  - FULL rank0_only: rank 0 holds its dict and at most one gathered unit (plus
//    the transport's scratch) beyond that; the other ranks one gathered unit (plus
//    scratch) while it runs and nothing after;
//  - save_checkpoint: no copies of the shards (a few KB of metadata buffers);
//  - consolidate: the largest item plus a constant.
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>

#include <torch/torch.h>

#include "comm/comm_testing.h"
#include "core/counting_allocator.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/summon_full_params.h"
#include "fsdp/state/checkpoint_tools.h"
#include "fsdp/state/state_dict.h"
#include "harness/multirank.h"
#include "harness/temp_dir.h"

using namespace fsdp;
using namespace fsdp::testing;
using fsdp::memory::install_counting_allocator;

namespace {


constexpr int kWorld = 3;
// Four 256x256 layers, one unit each (65,792 elements = 263,168 B), gathered into a
// flat buffer padded to a multiple of N (65,793 elements = 263,172 B).
constexpr int64_t kUnitNumel = 256 * 256 + 256;
constexpr int64_t kUnitBytes = kUnitNumel * 4;
constexpr int64_t kPaddedUnitBytes = (kUnitNumel + kWorld - 1) / kWorld * kWorld * 4;
constexpr int64_t kModelBytes = 4 * kUnitBytes;
constexpr int64_t kSlack = 32 * 1024;  // small tensors of save_checkpoint: lengths, flags, metadata strings

// What a FULL state dict allocates to gather one unit, beyond the dict: the unit's
// padded flat buffer, plus on Gloo at N >= 3 (units under comm_alltoall_max_bytes go
// through Gloo's alltoall) a scratch of the rows going and coming: 2N rows of a shard
// behind a 64-byte header each. The shared-memory transport copies from its ring slots
// straight into the flat buffer.
constexpr int64_t kAlltoallScratchBytes = 2 * kWorld * (64 + kPaddedUnitBytes / kWorld);
int64_t gather_bytes(bool shared_memory) {
  return kPaddedUnitBytes + (shared_memory ? 0 : kAlltoallScratchBytes);
}

// Bytes of the distinct storages of every parameter, gradient and Adam state tensor.
int64_t training_state_bytes(const std::vector<at::Tensor>& params, const torch::optim::Adam& opt) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined() && seen.insert(t.storage().unsafeGetStorageImpl()).second)
      bytes += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : params) {
    add(p);
    add(p.grad());
  }
  for (const auto& kv : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*kv.second);
    add(s.exp_avg());
    add(s.exp_avg_sq());
    add(s.max_exp_avg_sq());
  }
  return bytes;
}

}  // namespace

TEST(StateMemory, FullRank0OnlySaveAndConsolidate) {
  // Made by the test process, borrowed by its workers; removed when the test
  // returns, after run_ranks has reaped them.
  const TempDir tmp = TempDir::from_env_or_create("FSDP_STATE_MEM_DIR", "fsdp-state-mem-");
  const std::string dir = tmp.path();
  RankOptions opts;
  opts.extra_env = {"FSDP_STATE_MEM_DIR=" + dir};
  run_ranks(kWorld, [dir](comm::ProcessGroup& pg) {
    auto* counter = install_counting_allocator();
    torch::manual_seed(0);
    torch::nn::Sequential net;
    for (int i = 0; i < 4; ++i) net->push_back(torch::nn::Linear(256, 256));
    FullyShardedDataParallel model(net, pg, Options().auto_wrap_policy(always_wrap_policy()));
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
    // What a rank holds between steps, measured at N=3 (rank 0): live 2,193,100 B = 350,896 parameter shards (4 padded
    // chunks of 21,931 floats) + 350,896 gradient storage (the reduced shards the
    // gradient pieces alias) + 2 x 350,896 Adam moments + 789,516 idle pool blocks (3
    // unit-sized blocks the step freed and the pool keeps for the next one; [Note:
    // buffer pool] in src/memory/buffer_pool.h). A state dict, gathered or not, leaves
    // all of it as it was: on ranks != 0 the same 2,193,100 B before and after.
    // An earlier version allowed a unit-sized leftover on ranks != 0 and hid a
    // release of about two units behind a warm-up state_dict call. Both were Gloo
    // alltoall works: c10d's work object kept the tensors it was given (the gathered
    // flat buffer; after the step, the last reduce-scatter's flat gradient and
    // scratch) until Gloo's worker thread let go of the work, which can be after
    // wait() returned, and late when that thread shares the pinned core with a busy
    // main thread; the next collective's wait let it run. Since 4d78412 Gloo gets
    // non-owning views and the handle owns the tensors until the work completes
    // (AlltoallLease in src/comm/gloo/gloo_alltoall.cpp); handing Gloo the owning tensors
    // again makes this test fail on some rank in every run (checked three times). The
    // bounds below are exact for what stays (nothing; the dict) on both transports,
    // measured from right after the step, without a warm-up call.
    auto step = [&] {
      auto x = torch::randn({6, 256});
      model->forward(x).sum().backward();
      opt.step();
      opt.zero_grad(/*set_to_none=*/false);
    };
    for (const bool shared_memory : {true, false}) {
      const std::string transport = shared_memory ? "shared memory" : "Gloo";
      comm::set_comm_shared_memory(shared_memory);  // every rank, same order
      step();
      run_case("after a step over " + transport + ": only training state and pool blocks", [&] {
        const auto stats = model->memory_stats();
        EXPECT_EQ(stats.unsharded_bytes, 0);
        EXPECT_EQ(counter->live(),
                  training_state_bytes(model->parameters(), opt) + stats.cached_bytes + comm::comm_cached_bytes())
            << "the step left buffers behind (pool idle " << stats.cached_bytes << " B, comm cached "
            << comm::comm_cached_bytes() << " B)";
      });
      run_case("FULL rank0_only over " + transport, [&] {
        const int64_t before = counter->live();
        const int64_t pooled_before = model->memory_stats().cached_bytes;
        counter->reset_peak();
        StateDict sd;
        {
          StateDictTypeGuard g(*model, StateDictType::kFull, FullStateDictConfig().rank0_only(true).offload_to_cpu(true));
          sd = state_dict(*model);
        }
        const int64_t extra_peak = counter->peak() - before;
        const int64_t held = counter->live() - before;
        // The pool is not used by state dicts: its idle blocks are neither taken nor added to.
        EXPECT_EQ(model->memory_stats().cached_bytes, pooled_before);
        if (pg.rank() == 0) {
          EXPECT_EQ(sd.size(), 8u);
          EXPECT_EQ(held, kModelBytes) << "rank 0 holds more or less than its dict";
          // At the last unit: three units copied out, the fourth gathered (and its scratch).
          EXPECT_LE(extra_peak, kModelBytes + gather_bytes(shared_memory))
              << "rank 0 held more than its dict + one unit";
          EXPECT_GE(extra_peak, 3 * kUnitBytes + gather_bytes(shared_memory));
        } else {
          EXPECT_EQ(sd.size(), 0u);
          EXPECT_EQ(held, 0) << "rank " << pg.rank() << " kept " << held << " B after the call";
          EXPECT_EQ(extra_peak, gather_bytes(shared_memory)) << "rank " << pg.rank() << " held more than one unit";
        }
        // The bound can fail: gathering everything at once costs the whole model.
        const int64_t before2 = counter->live();
        counter->reset_peak();
        fsdp::apply_with_full_params(*model, [](torch::nn::Module&) {});
        EXPECT_GT(counter->peak() - before2, kModelBytes) << "the comparison run should exceed the bound";
      });
    }
    comm::set_comm_shared_memory(true);
    run_case("save_checkpoint copies nothing", [&] {
      const int64_t before = counter->live();
      counter->reset_peak();
      save_checkpoint(dir + "/ckpt", *model, &opt);
      EXPECT_LE(counter->peak() - before, kSlack) << "save made copies of the shards";
    });
    const StateDict full = state_dict(*model);  // collective, every rank
    run_case("consolidate: largest item + constant", [&] {
      if (pg.rank() != 0) return;
      const int64_t before = counter->live();
      counter->reset_peak();
      consolidate_checkpoint(dir + "/ckpt", dir + "/full.pt");
      EXPECT_LE(counter->peak() - before, 256 * 256 * 4 + kSlack);
      EXPECT_GE(counter->peak() - before, 256 * 256 * 4);  // it did assemble the largest item
      // And the result is the model.
      std::ifstream in(dir + "/full.pt", std::ios::binary);
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      auto d = torch::pickle_load(bytes).toGenericDict();
      EXPECT_EQ(d.size(), 8u);
      for (const auto& kv : full) EXPECT_TRUE(torch::equal(d.at(kv.key()).toTensor(), kv.value())) << kv.key();
    });
  }, opts);
}
