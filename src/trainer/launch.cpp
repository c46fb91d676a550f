#include "fsdp/trainer/launch.h"

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/util/Exception.h>

// Set by CMakeLists.txt for this file: where fsdp-run lands in the build tree, where
// `cmake --install` puts it, and what the build's fsdp-run reports (--version).
#ifndef FSDP_BUILD_BINDIR
#define FSDP_BUILD_BINDIR ""
#endif
#ifndef FSDP_INSTALL_BINDIR
#define FSDP_INSTALL_BINDIR ""
#endif
#ifndef FSDP_VERSION
#define FSDP_VERSION "unknown"
#endif
#ifndef FSDP_BUILD_ID
#define FSDP_BUILD_ID "unknown"
#endif

extern char** environ;

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

/// The first line `path --version` writes to stdout; "" if none (an fsdp-run older than
/// --version refuses the option on stderr, which goes to /dev/null here).
std::string version_of(const std::string& path) {
  int fds[2];
  TORCH_CHECK(pipe(fds) == 0, "fsdp::Trainer: pipe() for ", path, " --version failed: ", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  std::string arg0 = path, arg1 = "--version";
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, path.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  std::string out;
  if (rc == 0) {
    char buf[256];
    for (;;) {
      const ssize_t n = read(fds[0], buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      if (out.size() < 4096) out.append(buf, size_t(n));
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  close(fds[0]);
  TORCH_CHECK(rc == 0, "fsdp::Trainer: cannot run ", path, " --version: ", std::strerror(rc));
  return out.substr(0, out.find('\n'));
}

/// Refuses an fsdp-run of another build than this library's ([Note: trainer launch]).
void check_launcher_version(const std::string& path) {
  const std::string theirs = version_of(path), ours = launcher_version();
  if (theirs == ours) return;
  const std::string prefix = "fsdp-run ";
  const std::string what = theirs.rfind(prefix, 0) == 0 ? "version " + theirs.substr(prefix.size())
                           : theirs.empty()           ? "of an older build (it does not answer --version)"
                                                      : "not fsdp-run (its --version says '" + theirs + "')";
  TORCH_CHECK(false, "fsdp::Trainer: fsdp-run at ", path, " is ", what, ", but this program was built with fsdp ",
              FSDP_VERSION, " (build ", FSDP_BUILD_ID, "); a launcher of another build may start the ranks "
              "differently. Use the fsdp-run of this program's build: rebuild and reinstall fsdp-run together with "
              "the library (cmake --build, cmake --install), or set TrainerOptions::launcher to it");
}

}  // namespace

std::string launcher_version() { return "fsdp-run " FSDP_VERSION " (build " FSDP_BUILD_ID ")"; }

bool under_launcher() {
  // The same variables fsdp::comm::parse_launch_env reads (launch_env.h).
  return std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr ||
         std::getenv("SLURM_PROCID") != nullptr || std::getenv("OMPI_COMM_WORLD_RANK") != nullptr;
}

std::string find_launcher(const std::string& explicit_path, const std::string& installed_bindir) {
  if (!explicit_path.empty()) {
    TORCH_CHECK(executable(explicit_path), "fsdp::Trainer: TrainerOptions::launcher '", explicit_path,
                "' is not an executable file; point it at fsdp-run (build target fsdp-run, installed in bin/)");
    check_launcher_version(explicit_path);
    return explicit_path;
  }
  const std::string self = self_exe();
  const std::string beside = self.substr(0, self.rfind('/')) + "/fsdp-run";
  std::vector<std::string> tried;
  if (!installed_bindir.empty()) {
    tried = {installed_bindir + "/fsdp-run", beside};
  } else {
    tried = {beside};
    if (*FSDP_BUILD_BINDIR) tried.push_back(std::string(FSDP_BUILD_BINDIR) + "/fsdp-run");
    if (*FSDP_INSTALL_BINDIR) tried.push_back(std::string(FSDP_INSTALL_BINDIR) + "/fsdp-run");
  }
  if (const char* path = std::getenv("PATH")) {
    std::string p = path;
    for (size_t start = 0; start <= p.size();) {
      size_t end = p.find(':', start);
      if (end == std::string::npos) end = p.size();
      if (end > start) tried.push_back(p.substr(start, end - start) + "/fsdp-run");
      start = end + 1;
    }
  }
  for (const auto& t : tried) {
    if (!executable(t)) continue;
    check_launcher_version(t);
    return t;
  }
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
