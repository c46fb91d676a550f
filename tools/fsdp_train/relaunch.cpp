#include "relaunch.h"

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <unistd.h>

namespace fsdp::train {

bool under_launcher() {
  return std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr ||
         std::getenv("SLURM_PROCID") != nullptr || std::getenv("OMPI_COMM_WORLD_RANK") != nullptr;
}

std::string relaunch_under_fsdp_run(int nproc, int argc, char** argv) {
  // /proc/self/exe, not argv[0]: argv[0] may be a bare name found through PATH.
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return std::string("cannot read /proc/self/exe: ") + std::strerror(errno);
  self[n] = '\0';
  std::string self_path(self);
  std::string dir = self_path.substr(0, self_path.rfind('/'));
  std::string launcher = dir + "/fsdp-run";
  if (access(launcher.c_str(), X_OK) != 0)
    return "not started by a launcher and " + launcher +
           " is not executable: build the fsdp-run target (it lands next to fsdp-train), "
           "or start fsdp-train under fsdp-run/torchrun/srun/mpirun";

  std::vector<std::string> args = {launcher, "--nproc", std::to_string(nproc), "--", self_path};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  execv(launcher.c_str(), cargs.data());
  return "execv " + launcher + " failed: " + std::strerror(errno);
}

}  // namespace fsdp::train
