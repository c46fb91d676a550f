// Environment parsing for torchrun (with and without the agent store), Slurm and
// OpenMPI, explicit overrides, and the documented error messages.
#include <gtest/gtest.h>

#include "fsdp/comm/launch_env.h"
#include "harness/error_of.h"

using fsdp::comm::LaunchSource;
using fsdp::comm::map_env;
using fsdp::comm::parse_launch_env;

using fsdp::testing::error_of;

namespace {

}  // namespace

TEST(LaunchEnv, Torchrun) {
  auto env = parse_launch_env(map_env({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                       {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.5"},
                                       {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(env.source, LaunchSource::kTorchrun);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.5");
  EXPECT_EQ(env.master_port, 1234);
  EXPECT_FALSE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 0);
}

TEST(LaunchEnv, TorchrunAgentStore) {
  auto env = parse_launch_env(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                                       {"MASTER_PORT", "29400"},
                                       {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                       {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_TRUE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 2);
  auto env2 = parse_launch_env(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                                        {"MASTER_PORT", "29400"},
                                        {"TORCHELASTIC_USE_AGENT_STORE", "False"}}));
  EXPECT_FALSE(env2.use_agent_store);
}

TEST(LaunchEnv, TorchrunMissingMaster) {
  auto msg = error_of([] {
    parse_launch_env(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}));
  });
  EXPECT_NE(msg.find("MASTER_ADDR"), std::string::npos) << msg;
  msg = error_of([] {
    parse_launch_env(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "x"}}));
  });
  EXPECT_NE(msg.find("MASTER_PORT"), std::string::npos) << msg;
}

TEST(LaunchEnv, BadValues) {
  auto msg = error_of([] {
    parse_launch_env(map_env({{"RANK", "two"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "x"},
                              {"MASTER_PORT", "1"}}));
  });
  EXPECT_NE(msg.find("RANK='two'"), std::string::npos) << msg;
  msg = error_of([] {
    parse_launch_env(map_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "x"},
                              {"MASTER_PORT", "1"}}));
  });
  EXPECT_NE(msg.find("rank 2 is outside [0, 2)"), std::string::npos) << msg;
}

TEST(LaunchEnv, Slurm) {
  auto env = parse_launch_env(map_env({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"},
                                       {"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "4"},
                                       {"SLURM_JOB_NODELIST", "gpu[003-004,9],cpu1"}}));
  EXPECT_EQ(env.source, LaunchSource::kSlurm);
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "gpu003");
  EXPECT_EQ(env.master_port, 29500);
  // MASTER_ADDR wins over the node list.
  auto env2 = parse_launch_env(map_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},
                                        {"SLURM_JOB_NODELIST", "n1"}, {"MASTER_ADDR", "head"},
                                        {"MASTER_PORT", "777"}}));
  EXPECT_EQ(env2.master_addr, "head");
  EXPECT_EQ(env2.master_port, 777);
  auto msg = error_of([] {
    parse_launch_env(map_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}));
  });
  EXPECT_NE(msg.find("set MASTER_ADDR"), std::string::npos) << msg;
}

// A job whose nodes run different numbers of tasks: LOCAL_WORLD_SIZE is this node's entry of
// the per-node counts ("2(x3),1": nodes 0-2 run 2 tasks, node 3 runs 1), the step's counts win
// over the allocation's, and a node index beyond the list is an error naming both.
TEST(LaunchEnv, SlurmTasksOnThisNode) {
  auto on_node = [](const char* node, std::map<std::string, std::string> extra) {
    std::map<std::string, std::string> vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "7"},
                                            {"SLURM_NODEID", node}, {"MASTER_ADDR", "h"}};
    vars.insert(extra.begin(), extra.end());
    return parse_launch_env(map_env(vars)).local_world_size;
  };
  const std::map<std::string, std::string> alloc{{"SLURM_TASKS_PER_NODE", "2(x3),1"}};
  EXPECT_EQ(on_node("0", alloc), 2);
  EXPECT_EQ(on_node("2", alloc), 2);
  EXPECT_EQ(on_node("3", alloc), 1);
  EXPECT_EQ(on_node("1", {{"SLURM_TASKS_PER_NODE", "3,1(x2),5"}}), 1);
  EXPECT_EQ(on_node("3", {{"SLURM_TASKS_PER_NODE", "3,1(x2),5"}}), 5);
  EXPECT_EQ(on_node("1", {{"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_STEP_TASKS_PER_NODE", "3,1"}}), 1);
  EXPECT_EQ(on_node("1", {{"SLURM_NTASKS_PER_NODE", "3"}}), 3);
  auto msg = error_of([&] { on_node("4", alloc); });
  EXPECT_NE(msg.find("SLURM_NODEID=4 but SLURM_TASKS_PER_NODE='2(x3),1' lists only 4 nodes"),
            std::string::npos) << msg;
  msg = error_of([&] { on_node("0", {{"SLURM_TASKS_PER_NODE", "2(3)"}}); });
  EXPECT_NE(msg.find("cannot read SLURM_TASKS_PER_NODE='2(3)'"), std::string::npos) << msg;
}

TEST(LaunchEnv, SlurmNodeList) {
  EXPECT_EQ(fsdp::comm::slurm_first_host("node1"), "node1");
  EXPECT_EQ(fsdp::comm::slurm_first_host("node1,node2"), "node1");
  EXPECT_EQ(fsdp::comm::slurm_first_host("node[003-005]"), "node003");
  EXPECT_EQ(fsdp::comm::slurm_first_host("a[7,9-10]-ib"), "a7-ib");
}

TEST(LaunchEnv, OpenMPI) {
  auto env = parse_launch_env(map_env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_ADDR", "n0"}}));
  EXPECT_EQ(env.source, LaunchSource::kOpenMpi);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "n0");
  // Single node: loopback is implied.
  auto one = parse_launch_env(map_env({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  EXPECT_EQ(one.master_addr, "127.0.0.1");
  // Across nodes without MASTER_ADDR: the message names the variable.
  auto msg = error_of([] {
    parse_launch_env(map_env({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  });
  EXPECT_NE(msg.find("set MASTER_ADDR"), std::string::npos) << msg;
}

TEST(LaunchEnv, ExplicitOverridesEnvironment) {
  fsdp::comm::LaunchOverrides ov;
  ov.rank = 1;
  ov.world_size = 3;
  ov.master_port = 4000;
  auto env = parse_launch_env(map_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"},
                                       {"MASTER_PORT", "1"}}),
                              ov);
  EXPECT_EQ(env.source, LaunchSource::kExplicit);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 3);
  EXPECT_EQ(env.master_addr, "a");
  EXPECT_EQ(env.master_port, 4000);
  auto single = parse_launch_env(map_env({}));
  EXPECT_EQ(single.source, LaunchSource::kSingleProcess);
  EXPECT_EQ(single.world_size, 1);
}
