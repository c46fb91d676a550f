// Asynchronous checkpoints (fsdp/state/async_checkpoint.h). The writer is throttled (the
// record hook holds it after its first record until training has run two more steps), so
// training overwrites the state while the save is written, through copy-on-write faults
// (pages copied > 0); the files must still be byte for byte those of a blocking save at the
// save's step, for FSDP strategies, zero-copy gathers,
// CPU offload, bf16, the optimizer in backward and ZeRO-2. A failed write is raised on every
// rank, naming the rank and the cause; a rank killed while its writer is mid-file leaves the
// previous checkpoint in place; skip_if_busy skips on every rank alike.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/optim/cpu_adam.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/zero_checkpoint.h"
#include "harness/error_of.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/test_dir.h"
#include "state/checkpoint_testing.h"
#include "state/direct_file.h"

using namespace fsdp;
using namespace fsdp::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBatch = 12;
using Model = FullyShardedDataParallel<TinyTransformerImpl>;
using Clock = std::chrono::steady_clock;

// Training steps this process has finished; the throttled writer waits on it.
std::atomic<int64_t> g_steps{0};

// After its first record the writer waits until training has finished `steps` more steps
// than when the save began (at most 60 s: then the save fails, and so the test).
void throttle_writer(int64_t steps) {
  const int64_t until = g_steps.load() + steps;
  state::detail::set_checkpoint_record_hook([until](int64_t written) {
    if (written != 1) return;
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (g_steps.load() < until) {
      TORCH_CHECK(Clock::now() < deadline, "test: training did not run while the writer waited");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
}

// `steps` steps of this rank's slice of the global batch on `device`, counted in g_steps.
void train_steps(const std::function<torch::Tensor(const torch::Tensor&)>& forward, torch::optim::Optimizer& opt,
                 int64_t steps, const comm::ProcessGroup& pg, const torch::Device& device = torch::kCPU) {
  for (int64_t i = 0; i < steps; ++i) {
    auto [x, y] = global_batch(g_steps.load(), kBatch);
    opt.zero_grad(/*set_to_none=*/true);
    auto out = forward(rank_slice(x, pg.rank(), pg.size()).to(device));
    torch::mse_loss(out.to(torch::kFloat), rank_slice(y, pg.rank(), pg.size()).to(device)).backward();
    opt.step();  // nothing left to step under optimizer_in_backward
    ++g_steps;
  }
}

void train_fsdp(Model& m, torch::optim::Optimizer& opt, int64_t steps, const comm::ProcessGroup& pg) {
  train_steps([&](const torch::Tensor& x) { return m->forward(x); }, opt, steps, pg);
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Whether the file system under `dir` takes O_DIRECT writes ([Note: direct writes]).
bool direct_io_supported(const std::string& dir) {
  bool direct = false;
  {
    state::format::DirectFile probe(dir + "/direct_probe");
    std::unique_ptr<char, decltype(&std::free)> block(static_cast<char*>(std::aligned_alloc(4096, 4096)), &std::free);
    std::memset(block.get(), 0, 4096);
    probe.write_at(0, block.get(), 4096);
    direct = probe.direct_bytes() > 0;
  }
  fs::remove(dir + "/direct_probe");
  return direct;
}

// Every file of `expected` is in `got` with the same bytes, and `got` has no others.
void expect_same_files(const std::string& got, const std::string& expected) {
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(expected)) {
    ++n;
    const fs::path other = fs::path(got) / e.path().filename();
    ASSERT_TRUE(fs::exists(other)) << other;
    EXPECT_TRUE(file_bytes(e.path()) == file_bytes(other)) << other << " differs from " << e.path();
  }
  EXPECT_EQ(size_t(std::distance(fs::directory_iterator(got), fs::directory_iterator())), n) << got;
}

// fsdp-ckpt inspect (which verifies every record's CRC-32) accepts the directory.
void expect_inspect_verifies(const std::string& dir) {
  const char* bin = std::getenv("FSDP_BIN_DIR");
  ASSERT_NE(bin, nullptr) << "run under ctest (FSDP_BIN_DIR)";
  const std::string cmd = std::string(bin) + "/fsdp-ckpt inspect '" + dir + "' > /dev/null";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// The schedule trace shows the snapshot on the phases track and the writer on the checkpoint
// track, and training's forward spans inside the writer's span (it wrote while training ran).
void expect_writer_traced(const std::vector<TraceSpan>& spans, const std::string& dir) {
  const TraceSpan* snapshot = nullptr;
  const TraceSpan* writer = nullptr;
  for (const auto& s : spans) {
    if (s.name == "checkpoint snapshot " + dir) snapshot = &s;
    if (s.name == "checkpoint write " + dir) writer = &s;
  }
  ASSERT_NE(snapshot, nullptr) << "no snapshot span";
  ASSERT_NE(writer, nullptr) << "no writer span";
  EXPECT_EQ(snapshot->tid, Tracer::kPhase);
  EXPECT_EQ(writer->tid, Tracer::kCheckpoint);
  EXPECT_GE(writer->begin_seq, snapshot->begin_seq);
  int forwards_inside = 0;
  for (const auto& s : spans)
    if (s.name.rfind("forward", 0) == 0 && s.begin_seq > writer->begin_seq && s.end_seq < writer->end_seq)
      ++forwards_inside;
  EXPECT_GT(forwards_inside, 0) << "training ran no forward while the writer wrote";
}

struct FsdpCase {
  std::string name;
  Options options;
  std::string optimizer = "adam";
};

std::vector<FsdpCase> fsdp_cases() {
  const auto all = Options().auto_wrap_policy(always_wrap_policy());
  return {
      {"full_shard", Options(all).sharding_strategy(ShardingStrategy::kFullShard).trace_dir(test_dir() + "/trace")},
      {"shard_grad_op", Options(all).sharding_strategy(ShardingStrategy::kShardGradOp)},
      {"no_shard", Options(all).sharding_strategy(ShardingStrategy::kNoShard)},
      {"zero_copy_gather", Options(all).zero_copy_gather(true)},
      {"cpu_offload", Options(all).cpu_offload(true), "cpu_adam"},
      {"bf16", Options(all).mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16))},
      {"optimizer_in_backward", Options(all).optimizer_in_backward(true)},
  };
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, Model& m) {
  if (kind == "cpu_adam") return std::make_unique<optim::CPUAdam>(m->parameters(), optim::CPUAdamOptions(1e-2));
  return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-2));
}

// A blocking save at step 3 and an asynchronous one right after it, written while two
// more steps run: the same files.
void fsdp_case(const FsdpCase& c, comm::ProcessGroup& pg) {
  run_case(c.name, [&] {
    const std::string base = test_dir() + "/" + c.name;
    auto m = Model(make_transformer(3), pg, c.options);
    auto opt = make_optimizer(c.optimizer, m);
    if (c.options.optimizer_in_backward()) m->register_optimizer_in_backward(*opt);
    train_fsdp(m, *opt, 3, pg);
    CheckpointExtra extra;
    extra.values["step"] = "3";
    save_checkpoint(base + "/blocking", *m, opt.get(), extra);
    throttle_writer(2);
    CheckpointHandle h = save_checkpoint_async(base + "/async", *m, opt.get(), extra);
    EXPECT_FALSE(h.done()) << "the writer is held until two steps have run";
    train_fsdp(m, *opt, 2, pg);
    h.wait();
    state::detail::set_checkpoint_record_hook({});
    EXPECT_TRUE(h.done());
    EXPECT_EQ(h.error(), "");
    const CheckpointSaveStats s = h.stats();
    if (pg.rank() == 0 || c.options.sharding_strategy() != ShardingStrategy::kNoShard) {  // NO_SHARD: rank 0 writes
      EXPECT_GT(s.file_bytes, 0);
      // The optimizer state (and the shards, but for zero-copy gathers') protected copy-on-write;
      // the two steps wrote some of it before the held writer took it.
      EXPECT_GT(s.cow_bytes, 0);
      EXPECT_GT(s.cow_pages_copied, 0) << "no page was copied on write";
      EXPECT_GT(s.cow_fault_s, 0);
    }
    EXPECT_GT(s.background_s, 0);
    EXPECT_FALSE(s.blocking);
    comm::barrier(pg);  // rank 0 has published
    expect_same_files(base + "/async", base + "/blocking");
    EXPECT_FALSE(fs::exists(base + "/async.tmp"));
    if (pg.rank() == 0) expect_inspect_verifies(base + "/async");
    if (!c.options.trace_dir().empty()) expect_writer_traced(m->trace_spans(), base + "/async");
  });
}

TEST(AsyncCheckpoint, ThrottledWriterWritesTheBlockingSavesBytes) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    for (const auto& c : fsdp_cases()) fsdp_case(c, pg);
  }, rank_options());
}

// prepare_async_checkpoint moves the state onto pages of its own after the first step, so
// the first save's call copies nothing; records of whole pages then go to the disk straight
// from memory ([Note: direct writes]) where the file system takes O_DIRECT, and a save
// through the page cache writes the same bytes. Records of 2 x 64 KiB per rank: whole blocks.
TEST(AsyncCheckpoint, PreparedStateIsWrittenStraightFromMemory) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const std::string base = test_dir() + "/direct";
    torch::manual_seed(0);
    torch::nn::Sequential net(torch::nn::Linear(256, 128), torch::nn::Linear(128, 256));
    auto m = FullyShardedDataParallel<torch::nn::SequentialImpl>(
        net, pg, Options().auto_wrap_policy(always_wrap_policy()));
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
    const auto x = torch::randn({4, 256});
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad(/*set_to_none=*/true);
      m->forward(x).pow(2).mean().backward();
      opt.step();
    }
    const int64_t prepared = prepare_async_checkpoint(*m, &opt);
    EXPECT_GE(prepared, 3 * 4 * (256 * 128 + 128) / 2) << "parameter shards and both Adam moments";
    CheckpointHandle h = save_checkpoint_async(base + "/async", *m, &opt);
    h.wait();
    const CheckpointSaveStats s = h.stats();
    EXPECT_LT(s.snapshot_bytes, 4096) << "the prepared state is protected, not copied";
    if (direct_io_supported(test_dir())) {
      EXPECT_GT(s.direct_bytes, s.file_bytes / 2) << "whole pages should bypass the page cache";
    } else {
      std::cout << "[ NOTE ] " << test_dir() << " refuses O_DIRECT: only the same-bytes checks ran\n";
    }
    state::detail::set_checkpoint_direct_io(false);
    save_checkpoint(base + "/buffered", *m, &opt);
    state::detail::set_checkpoint_direct_io(true);
    comm::barrier(pg);
    expect_same_files(base + "/async", base + "/buffered");
    if (pg.rank() == 0) expect_inspect_verifies(base + "/async");
  }, rank_options());
}

TEST(AsyncCheckpoint, ZeroStage2ThrottledWriterWritesTheBlockingSavesBytes) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    for (bool in_backward : {false, true}) {
      run_case(in_backward ? "zero2_in_backward" : "zero2", [&] {
        const std::string base = test_dir() + (in_backward ? "/zero2ib" : "/zero2");
        auto net = make_transformer(5);
        optim::ZeroRedundancyOptimizer opt(
            net->parameters(), optim::inner_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2)),
            optim::ZeroOptions().process_group(pg).stage(2).reduce_bucket_size(300).module(net.ptr())
                .optimizer_in_backward(in_backward));
        auto train = [&](int64_t steps) {
          train_steps([&](const torch::Tensor& x) { return net->forward(x); }, opt, steps, pg);
        };
        train(3);
        save_checkpoint(base + "/blocking", opt);
        throttle_writer(2);
        CheckpointHandle h = save_checkpoint_async(base + "/async", opt);
        train(2);
        h.wait();
        state::detail::set_checkpoint_record_hook({});
        // The flat parameters live in the exchange arena (copied whole); AdamW's state is
        // protected copy-on-write, and the two steps wrote some of it first.
        EXPECT_GT(h.stats().snapshot_bytes, 0);
        EXPECT_GT(h.stats().cow_pages_copied, 0);
        comm::barrier(pg);
        expect_same_files(base + "/async", base + "/blocking");
      });
    }
  }, rank_options());
}

// AsyncCheckpointCuda (ctest label gpu; skips without a GPU): a model on the rank's GPU, whose
// records are copied to pinned memory on a side stream ([Note: device records in a
// snapshot]), and one whose shards are offloaded to pinned host memory (copied at the call).
// The two steps queued right after the save must not overwrite a tensor before its copy.
TEST(AsyncCheckpointCuda, ThrottledWriterWritesTheBlockingSavesBytes) {
  FSDP_SKIP_WITHOUT_GPU(1);
  RankOptions ro = rank_options();
  ro.backend = comm::Backend::kNccl;
  run_ranks(1, [](comm::ProcessGroup& pg) {
    const torch::Device gpu(torch::kCUDA, pg.cuda_device());
    for (bool offload : {false, true}) {
      run_case(offload ? "cpu_offload" : "on_gpu", [&] {
        const std::string base = test_dir() + (offload ? "/cuda_offload" : "/cuda");
        auto net = make_transformer(3);
        net->to(gpu);
        auto m = Model(net, pg, Options().auto_wrap_policy(always_wrap_policy()).cpu_offload(offload));
        auto opt = make_optimizer(offload ? "cpu_adam" : "adam", m);
        auto train = [&](int64_t steps) {
          train_steps([&](const torch::Tensor& x) { return m->forward(x); }, *opt, steps, pg, gpu);
        };
        train(3);
        save_checkpoint(base + "/blocking", *m, opt.get());
        throttle_writer(2);
        CheckpointHandle h = save_checkpoint_async(base + "/async", *m, opt.get());
        train(2);
        h.wait();
        state::detail::set_checkpoint_record_hook({});
        EXPECT_GT(h.stats().snapshot_bytes, 0);
        expect_same_files(base + "/async", base + "/blocking");
      });
    }
  }, ro);
}

// A write that fails on rank 1 is raised by wait() on both ranks, naming rank 1, its file
// and the cause; the previous checkpoint stays, and the next save succeeds.
TEST(AsyncCheckpoint, FailedWriteIsRaisedOnEveryRank) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const std::string dir = test_dir() + "/failing";
    auto m = Model(make_transformer(3), pg, Options().auto_wrap_policy(always_wrap_policy()));
    auto opt = make_optimizer("adam", m);
    train_fsdp(m, *opt, 1, pg);
    save_checkpoint(dir, *m, opt.get());
    const std::string before = file_bytes(dir + "/metadata.json");
    if (pg.rank() == 1)
      state::detail::set_checkpoint_record_hook([](int64_t written) {
        TORCH_CHECK(written != 2, "No space left on device (injected)");
      });
    train_fsdp(m, *opt, 1, pg);
    CheckpointHandle h = save_checkpoint_async(dir, *m, opt.get());
    train_fsdp(m, *opt, 1, pg);
    const std::string err = error_of([&] { h.wait(); });
    state::detail::set_checkpoint_record_hook({});
    EXPECT_NE(err.find("No space left on device (injected)"), std::string::npos) << err;
    EXPECT_NE(err.find(pg.rank() == 1 ? "on rank 1" : "failed on rank 1"), std::string::npos) << err;
    EXPECT_NE(err.find("shard_rank00001.bin"), std::string::npos) << err;
    EXPECT_NE(err.find("nothing was renamed into place"), std::string::npos) << err;
    EXPECT_EQ(h.error(), err);
    EXPECT_EQ(err.find("Exception raised from"), std::string::npos) << "C++ context in the message: " << err;
    comm::barrier(pg);
    EXPECT_EQ(file_bytes(dir + "/metadata.json"), before) << "the failed save replaced the checkpoint";
    // Raised once: the next save does not raise it again, and succeeds.
    save_checkpoint_async(dir, *m, opt.get()).wait();
    comm::barrier(pg);
    EXPECT_NE(file_bytes(dir + "/metadata.json"), before);
  }, rank_options());
}

// skip_if_busy: while a save is held mid-file, the next one is skipped on every rank.
TEST(AsyncCheckpoint, SkipIfBusySkipsOnEveryRank) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const std::string dir = test_dir() + "/busy";
    auto m = Model(make_transformer(3), pg, Options().auto_wrap_policy(always_wrap_policy()));
    auto opt = make_optimizer("adam", m);
    train_fsdp(m, *opt, 1, pg);
    throttle_writer(1);
    CheckpointHandle first = save_checkpoint_async(dir + "/a", *m, opt.get());
    CheckpointHandle second =
        save_checkpoint_async(dir + "/b", *m, opt.get(), {}, AsyncCheckpointOptions().skip_if_busy(true));
    EXPECT_FALSE(second.valid());
    EXPECT_TRUE(second.stats().skipped);
    EXPECT_EQ(skipped_checkpoints(), 1);
    train_fsdp(m, *opt, 1, pg);
    first.wait();
    state::detail::set_checkpoint_record_hook({});
    comm::barrier(pg);
    EXPECT_TRUE(fs::exists(dir + "/a/metadata.json"));
    EXPECT_FALSE(fs::exists(dir + "/b"));
    EXPECT_FALSE(fs::exists(dir + "/b.tmp"));
  }, rank_options());
}

// Both ranks are killed (SIGKILL) while their writers are held mid-file: the previous
// checkpoint is what a load finds, and the new one never appeared.
void killed_while_writing() {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const std::string dir = test_dir() + "/killed";
    auto m = Model(make_transformer(3), pg, Options().auto_wrap_policy(always_wrap_policy()));
    auto opt = make_optimizer("adam", m);
    train_fsdp(m, *opt, 2, pg);
    save_checkpoint(dir, *m, opt.get());
    if (pg.rank() == 0) torch::save(m->parameters(), dir + ".expected.pt");
    static std::atomic<bool> held{false};
    state::detail::set_checkpoint_record_hook([](int64_t written) {
      if (written != 2) return;
      held = true;
      std::this_thread::sleep_for(std::chrono::seconds(120));
    });
    train_fsdp(m, *opt, 1, pg);
    CheckpointHandle h = save_checkpoint_async(dir, *m, opt.get());
    while (!held) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ::raise(SIGKILL);
  }, rank_options());
}

TEST(AsyncCheckpoint, KilledMidFileLeavesThePreviousCheckpoint) {
  if (is_worker()) killed_while_writing();
  else EXPECT_NONFATAL_FAILURE(killed_while_writing(), "signal 9");
  EXPECT_TRUE(is_worker() || fs::exists(test_dir() + "/killed.tmp")) << "the killed save should have left its .tmp";
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const std::string dir = test_dir() + "/killed";
    auto m = Model(make_transformer(9), pg, Options().auto_wrap_policy(always_wrap_policy()));
    load_checkpoint(dir, *m, nullptr);
    std::vector<torch::Tensor> expected;
    torch::load(expected, dir + ".expected.pt");
    const auto got = m->parameters();
    ASSERT_EQ(got.size(), expected.size());
    // Each rank's shards: rank 0 saved its own, so compare on rank 0 only.
    if (pg.rank() == 0) {
      for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << i;
    }
  }, rank_options());
}

}  // namespace
