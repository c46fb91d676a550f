#include "rank_env.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <utility>

namespace fsdp::launcher {

std::vector<std::string> rank_environment(const char* const* base, const JobTopology& job,
                                          int local_rank) {
  // One role ("default") per job, one agent per node: ROLE_RANK is the global rank and
  // GROUP_RANK the node rank, as torchrun's static rendezvous assigns them.
  const std::string world = std::to_string(job.world_size());
  const std::string r = std::to_string(job.global_rank(local_rank));
  const std::vector<std::pair<std::string, std::string>> launcher_vars = {
      {"RANK", r},
      {"WORLD_SIZE", world},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(job.nproc_per_node)},
      {"GROUP_RANK", std::to_string(job.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(job.nnodes)},
      {"ROLE_RANK", r},
      {"ROLE_WORLD_SIZE", world},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", job.master_addr},
      {"MASTER_PORT", std::to_string(job.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(job.restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(job.max_restarts)},
      {"TORCHELASTIC_RUN_ID", "none"},
      // True: node 0's fsdp-run serves the store (with --max-restarts); every rank is a
      // client and keeps to keys under /worker/attempt_<restart count>. False: rank 0 serves it.
      {"TORCHELASTIC_USE_AGENT_STORE", job.agent_store ? "True" : "False"},
  };

  std::map<std::string, bool> overridden;
  for (const auto& [name, value] : launcher_vars) overridden[name] = true;

  std::vector<std::string> env;
  bool has_omp_threads = false;
  for (const char* const* entry = base; entry != nullptr && *entry != nullptr; ++entry) {
    std::string text = *entry;
    std::string name = text.substr(0, text.find('='));
    if (overridden.count(name)) continue;
    if (name == "OMP_NUM_THREADS") has_omp_threads = true;
    env.push_back(std::move(text));
  }
  for (const auto& [name, value] : launcher_vars) env.push_back(name + "=" + value);
  if (!has_omp_threads) env.push_back("OMP_NUM_THREADS=1");
  return env;
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    throw LauncherError(std::string("cannot create a socket to pick MASTER_PORT: ") +
                        std::strerror(errno) + "; pass --master-port PORT");
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    ::close(fd);
    throw LauncherError(std::string("cannot bind 127.0.0.1:0 to pick MASTER_PORT: ") +
                        std::strerror(err) + "; pass --master-port PORT");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace fsdp::launcher
