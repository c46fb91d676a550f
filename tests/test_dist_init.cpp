// Rendezvous and failure behaviour: TCPStore served by rank 0, torchrun's agent
// store, world-size disagreement, a rank claimed twice, a rank that dies (named in
// under 5 s with a 60 s timeout, shared memory and Gloo), a rank that stalls.
// Orderings between ranks go through the store or files, never fixed sleeps.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <csignal>

#include <fstream>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fsdp/comm/collectives.h"
#include "harness/error_of.h"
#include "harness/multirank.h"

using namespace fsdp;
using fsdp::testing::run_ranks;

using fsdp::testing::error_of;

namespace {

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

// Rank 0 picks a port and tells the others through the harness's group.
int shared_port(comm::ProcessGroup& pg) {
  auto t = torch::zeros({1}, torch::kLong);
  if (pg.rank() == 0) t.fill_(free_port());
  comm::broadcast(pg, t, 0).wait();
  return static_cast<int>(t.item<int64_t>());
}

comm::InitOptions tcp_options(int rank, int world, int port, std::chrono::milliseconds timeout) {
  comm::LaunchOverrides ov;
  ov.rank = rank;
  ov.world_size = world;
  ov.master_addr = "127.0.0.1";
  ov.master_port = port;
  return comm::InitOptions().overrides(ov).timeout(timeout);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TEST(DistInit, TcpStoreServedByRankZero) {
  run_ranks(3, [](comm::ProcessGroup& harness) {
    const int port = shared_port(harness);
    auto pg = comm::init_process_group(tcp_options(harness.rank(), 3, port, std::chrono::seconds(20)));
    EXPECT_EQ(pg.rank(), harness.rank());
    EXPECT_EQ(pg.size(), 3);
    auto t = torch::ones({4});
    comm::all_reduce(pg, t).wait();
    EXPECT_EQ(t[0].item<float>(), 3.0f);
    EXPECT_NE(pg.describe_peer(1).find("pid"), std::string::npos);
    comm::barrier(pg);
  });
}

TEST(DistInit, TorchrunAgentStore) {
  // The "agent" (here: a store served by the harness rank 0) listens on the port;
  // every rank connects as a client under /worker/attempt_<restart count>.
  run_ranks(2, [](comm::ProcessGroup& harness) {
    const int port = shared_port(harness);
    c10::intrusive_ptr<c10d::TCPStore> agent;
    if (harness.rank() == 0) {
      c10d::TCPStoreOptions o;
      o.port = port;
      o.isServer = true;
      o.waitWorkers = false;
      agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
    }
    comm::barrier(harness);
    setenv("RANK", std::to_string(harness.rank()).c_str(), 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
    setenv("TORCHELASTIC_RESTART_COUNT", "4", 1);
    auto pg = comm::init_process_group(comm::InitOptions().timeout(std::chrono::seconds(20)));
    EXPECT_TRUE(pg.launch_env().use_agent_store);
    auto t = torch::ones({2});
    comm::all_reduce(pg, t).wait();
    EXPECT_EQ(t[0].item<float>(), 2.0f);
    if (agent) {
      // Our keys live under the attempt prefix Python uses.
      EXPECT_TRUE(agent->check({"/worker/attempt_4/fsdp/init/world_size"}));
      EXPECT_FALSE(agent->check({"fsdp/init/world_size"}));
    }
    comm::barrier(pg);
    comm::barrier(harness);
  });
}

TEST(DistInit, WorldSizeMismatchFailsFastOnEveryRank) {
  run_ranks(2, [](comm::ProcessGroup& harness) {
    const int port = shared_port(harness);
    const int claimed_world = harness.rank() == 0 ? 2 : 3;
    // Rank 0 registers first so the mismatch is seen by rank 1: rank 1 waits on the
    // store rank 0 serves until rank 0's world size is there.
    if (harness.rank() == 1) {
      c10d::TCPStoreOptions o;
      o.port = static_cast<uint16_t>(port);
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = std::chrono::seconds(30);
      c10d::TCPStore store("127.0.0.1", o);
      // Polled: the store's wait() is not woken by compareSet, which registers it.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!store.check({"fsdp/init/world_size"})) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "rank 0 never registered";
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    auto start = std::chrono::steady_clock::now();
    auto msg = error_of([&] {
      comm::init_process_group(tcp_options(harness.rank(), claimed_world, port, std::chrono::seconds(3)));
    });
    EXPECT_FALSE(msg.empty()) << "rank " << harness.rank() << " did not fail";
    EXPECT_LT(seconds_since(start), 10.0);
    if (harness.rank() == 1) {
      EXPECT_NE(msg.find("started with world size 3"), std::string::npos) << msg;
      EXPECT_NE(msg.find("registered world size 2"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("are all 2 ranks running"), std::string::npos) << msg;
    }
  });
}

TEST(DistInit, RankClaimedTwice) {
  // Two processes both say RANK=0 on a shared store (agent store or FileStore):
  // the second is told at once; the first times out waiting for rank 1.
  run_ranks(2, [](comm::ProcessGroup& harness) {
    auto path = torch::zeros({1}, torch::kLong);
    if (harness.rank() == 0) path.fill_(static_cast<int64_t>(::getpid()));
    comm::broadcast(harness, path, 0).wait();
    const std::string file = "/tmp/fsdp-claim-" + std::to_string(path.item<int64_t>());
    // Rank 1 claims second: it waits on the same file until rank 0's claim is there
    // (numWorkers -1: this extra handle never removes the file).
    std::unique_ptr<c10d::FileStore> handshake;
    if (harness.rank() == 1) {
      handshake = std::make_unique<c10d::FileStore>(file, -1);
      handshake->wait({"fsdp/init/rank_claims/0"}, std::chrono::seconds(30));
    }
    comm::LaunchOverrides ov;
    ov.rank = 0;
    ov.world_size = 2;
    auto start = std::chrono::steady_clock::now();
    auto msg = error_of([&] {
      comm::init_process_group(comm::InitOptions().overrides(ov).file_store_path(file).timeout(
          std::chrono::seconds(3)));
    });
    EXPECT_LT(seconds_since(start), 10.0);
    if (harness.rank() == 1) {
      EXPECT_NE(msg.find("rank 0 was claimed by two processes"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("are all 2 ranks running"), std::string::npos) << msg;
    }
    comm::barrier(harness);
    if (harness.rank() == 0) ::unlink(file.c_str());
  });
}

// Bare processes, no launcher: rank 2 vanishes after rendezvous; the others' next
// collective fails and names it. The collective timeout is 60 s and the bound 5 s:
// only the dead-peer path (not the timeout, which prints a similar message) can
// pass, with room for a loaded 2-core machine. On both transports.
void dead_rank_is_named(const std::vector<std::string>& env) {
  fsdp::testing::RankOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(60000);
  opts.extra_env = env;
  run_ranks(3, [](comm::ProcessGroup& pg) {
    auto pid = torch::full({1}, static_cast<int64_t>(::getpid()));
    comm::broadcast(pg, pid, 2).wait();
    if (pg.rank() == 2) fsdp::testing::exit_worker_now();
    // No wait for the harness to reap rank 2: an exited rank that is not reaped yet
    // (a zombie) must be named too (process_gone.h).
    auto start = std::chrono::steady_clock::now();
    auto msg = error_of([&] {
      for (int i = 0; i < 3; ++i) {
        auto t = torch::ones({1 << 16});
        comm::all_reduce(pg, t).wait();
      }
    });
    const double took = seconds_since(start);
    std::cout << "rank " << pg.rank() << " named the dead rank after " << took << " s\n";
    EXPECT_LT(took, 5.0) << msg;
    EXPECT_NE(msg.find("all_reduce on group 'world' failed on rank"), std::string::npos) << msg;
    EXPECT_NE(msg.find("gone: rank 2"), std::string::npos) << msg;
  }, opts);
}

TEST(DistInit, DeadRankIsNamedFastSharedMemory) { dead_rank_is_named({}); }
TEST(DistInit, DeadRankIsNamedFastGloo) { dead_rank_is_named({"FSDP_SHARED_MEMORY=0"}); }

TEST(DistInit, SharedMemoryStallIsNamedAndPeersFailFast) {
  // Shared-memory transport: rank 1 stops calling collectives (alive, not exited). Rank 0
  // times out naming it; rank 1's next collective then fails at once, because rank 0
  // raised its failure flag, instead of waiting out its own timeout.
  fsdp::testing::RankOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(3000);
  run_ranks(2, [](comm::ProcessGroup& pg) {
    ASSERT_NE(pg.shm_channel(), nullptr);
    // Rank 0 leaves this file once it has given up; rank 1 calls its next collective
    // only then (a handshake, not a sleep that has to outlast rank 0's timeout).
    const std::string gave_up = fsdp::testing::worker_scratch_dir() + "/rank0-gave-up";
    auto t = torch::ones({1 << 20});
    comm::all_reduce(pg, t).wait();  // both present: works
    EXPECT_EQ(t[0].item<float>(), 2.0f);
    if (pg.rank() == 1) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!std::ifstream(gave_up).good()) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "rank 0 never gave up";
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    auto start = std::chrono::steady_clock::now();
    auto msg = error_of([&] { comm::all_reduce(pg, t).wait(); });
    const double took = seconds_since(start);
    EXPECT_NE(msg.find("all_reduce on group 'world' failed on rank " + std::to_string(pg.rank())),
              std::string::npos) << msg;
    if (pg.rank() == 0) {
      std::ofstream(gave_up) << "1\n";
      // Not before the timeout; after it, a loaded machine may add seconds.
      EXPECT_GT(took, 2.9);
      EXPECT_LT(took, 10.0);
      EXPECT_NE(msg.find("timed out after 3000 ms: no data from rank 1"), std::string::npos) << msg;
    } else {
      // Well inside its own 3 s timeout: rank 0's failure flag ends the wait.
      EXPECT_LT(took, 1.5);
      EXPECT_NE(msg.find("rank 0 [pid"), std::string::npos) << msg;
      EXPECT_NE(msg.find("gave up on the group"), std::string::npos) << msg;
    }
    // The channel stays failed: later calls say so at once.
    auto again = error_of([&] { comm::all_gather_into(pg, torch::empty({4}), torch::ones({2})).wait(); });
    EXPECT_NE(again.find("shared-memory transport failed earlier"), std::string::npos) << again;
  }, opts);
}

TEST(DistInit, SharedMemoryCanBeTurnedOff) {
  // FSDP_SHARED_MEMORY=0: no channel, and collectives go through Gloo.
  fsdp::testing::RankOptions opts;
  opts.extra_env = {"FSDP_SHARED_MEMORY=0"};
  run_ranks(2, [](comm::ProcessGroup& pg) {
    EXPECT_EQ(pg.shm_channel(), nullptr);
    auto sub = pg.new_subgroup({0, 1});
    EXPECT_EQ(sub.shm_channel(), nullptr);
    auto t = torch::full({3}, float(pg.rank() + 1));
    comm::all_reduce(sub, t).wait();
    EXPECT_TRUE(torch::equal(t, torch::full({3}, 3.0f)));
  }, opts);
}

TEST(DistInit, BadShmSlotSizeIsRefusedBeforeRendezvous) {
  // FSDP_SHM_SLOT_KIB is read once by init_process_group and checked before it contacts
  // the store: nothing listens on this port, yet the error names the variable at once.
  const int port = free_port();
  for (const char* bad : {"abc", "0", "-4", "64k"}) {
    ::setenv("FSDP_SHM_SLOT_KIB", bad, 1);
    const auto start = std::chrono::steady_clock::now();
    const auto msg = error_of([&] {
      comm::init_process_group(tcp_options(0, 2, port, std::chrono::seconds(20)));
    });
    EXPECT_LT(seconds_since(start), 5.0) << bad;
    EXPECT_NE(msg.find("FSDP_SHM_SLOT_KIB='" + std::string(bad) + "' is not a slot size in KiB"),
              std::string::npos) << msg;
  }
  ::unsetenv("FSDP_SHM_SLOT_KIB");
}

// Backend::kNccl where no rank has a GPU: refused on every rank at init, naming the way out,
// never a hang in NCCL's first collective. A second world over the harness's store, under a
// prefix of its own. The workers see no CUDA device (CUDA_VISIBLE_DEVICES empty), so a GPU
// machine checks this too (test_cuda_comm covers NCCL on its GPU).
TEST(DistInit, NcclWithoutAGpuIsRefusedOnEveryRank) {
  fsdp::testing::RankOptions no_gpu;
  no_gpu.extra_env.push_back("CUDA_VISIBLE_DEVICES=");
  run_ranks(2, [](comm::ProcessGroup& pg) {
    EXPECT_EQ(pg.cuda_device(), -1);
    EXPECT_EQ(pg.device_transport(), nullptr);
    auto opts = fsdp::testing::worker_init_options().backend(comm::Backend::kNccl).store_prefix("nccl-try");
    try {
      comm::init_process_group(opts);
      ADD_FAILURE() << "Backend::kNccl without a GPU was accepted";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("Backend::kNccl"), std::string::npos) << msg;
      EXPECT_NE(msg.find("Backend::kGloo"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank " + std::to_string(pg.rank())), std::string::npos) << msg;
    }
  }, no_gpu);
}
