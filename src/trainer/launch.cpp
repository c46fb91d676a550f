#include "fsdp/trainer/launch.h"

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include <unistd.h>

#include <c10/util/Exception.h>

// Set by CMakeLists.txt for this file: where fsdp-run lands in the build tree and
// where `cmake --install` puts it.
#ifndef FSDP_BUILD_BINDIR
#define FSDP_BUILD_BINDIR ""
#endif
#ifndef FSDP_INSTALL_BINDIR
#define FSDP_INSTALL_BINDIR ""
#endif

namespace fsdp::trainer {

namespace {

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  TORCH_CHECK(n > 0, "fsdp::Trainer: cannot read /proc/self/exe: ", std::strerror(errno));
  buf[n] = '\0';
  return buf;
}

bool executable(const std::string& path) { return !path.empty() && access(path.c_str(), X_OK) == 0; }

}  // namespace

bool under_launcher() {
  // The same variables fsdp::comm::parse_launch_env reads (launch_env.h).
  return std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr ||
         std::getenv("SLURM_PROCID") != nullptr || std::getenv("OMPI_COMM_WORLD_RANK") != nullptr;
}

std::string find_launcher(const std::string& explicit_path) {
  if (!explicit_path.empty()) {
    TORCH_CHECK(executable(explicit_path), "fsdp::Trainer: TrainerOptions::launcher '", explicit_path,
                "' is not an executable file; point it at fsdp-run (build target fsdp-run, installed in bin/)");
    return explicit_path;
  }
  const std::string self = self_exe();
  std::vector<std::string> tried = {self.substr(0, self.rfind('/')) + "/fsdp-run"};
  if (*FSDP_BUILD_BINDIR) tried.push_back(std::string(FSDP_BUILD_BINDIR) + "/fsdp-run");
  if (*FSDP_INSTALL_BINDIR) tried.push_back(std::string(FSDP_INSTALL_BINDIR) + "/fsdp-run");
  if (const char* path = std::getenv("PATH")) {
    std::string p = path;
    for (size_t start = 0; start <= p.size();) {
      size_t end = p.find(':', start);
      if (end == std::string::npos) end = p.size();
      if (end > start) tried.push_back(p.substr(start, end - start) + "/fsdp-run");
      start = end + 1;
    }
  }
  for (const auto& t : tried)
    if (executable(t)) return t;
  std::string where;
  for (size_t i = 0; i < tried.size() && i < 4; ++i) where += (i ? ", " : "") + tried[i];
  TORCH_CHECK(false, "fsdp::Trainer: devices > 1 and no launcher started this process, but no fsdp-run was found (",
              where, tried.size() > 4 ? ", PATH" : "", "); build or install fsdp-run, set TrainerOptions::launcher, "
              "or start the program under fsdp-run/torchrun/srun/mpirun");
}

void relaunch_under(const std::string& launcher, int nproc) {
  // The program's own arguments, as the kernel recorded them (NUL-separated).
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> original;
  for (size_t start = 0; start < raw.size();) {
    size_t end = raw.find('\0', start);
    if (end == std::string::npos) end = raw.size();
    original.push_back(raw.substr(start, end - start));
    start = end + 1;
  }
  // /proc/self/exe, not argv[0]: argv[0] may be a bare name found through PATH.
  std::vector<std::string> args = {launcher, "--nproc", std::to_string(nproc), "--", self_exe()};
  for (size_t i = 1; i < original.size(); ++i) args.push_back(original[i]);
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  execv(launcher.c_str(), cargs.data());
  TORCH_CHECK(false, "fsdp::Trainer: execv ", launcher, " failed: ", std::strerror(errno));
}

}  // namespace fsdp::trainer
