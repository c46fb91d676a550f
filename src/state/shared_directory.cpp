// See [Note: checkpoint directories are shared] in shared_directory.h.
#include "shared_directory.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include <unistd.h>


namespace fsdp::state {

namespace {

constexpr const char* kProbeFile = ".fsdp-shared-directory-probe";

// Unique per save: host, pid, time and a random draw.
std::string make_token() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::ostringstream os;
  os << host << ':' << ::getpid() << ':' << std::chrono::system_clock::now().time_since_epoch().count() << ':'
     << std::random_device{}();
  return os.str();
}

// "" when `path` holds `token`, else why not.
std::string read_probe(const std::string& path, const std::string& token) {
  std::ifstream f(path);
  if (!f) return std::strerror(errno);
  std::string got((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (got != token) return "the file there holds another save's token (a stale copy)";
  return "";
}

}  // namespace

std::string check_shared_directory(const StoreAgreement& agree, const std::string& dir,
                                   const std::string& shown_dir, const char* what) {
  const comm::ProcessGroup& pg = agree.group();
  if (pg.size() == 1) return "";
  const std::string probe = dir + "/" + kProbeFile;
  std::string token;
  if (pg.rank() == 0) {
    token = make_token();
    std::ofstream(probe) << token;  // a failed write shows as rank 0's own read failing
  }
  // Received after rank 0 wrote (and closed) the file.
  if (pg.rank() == 0) agree.post("probe-token", token);
  token = agree.from(0, "probe-token");
  std::string mine = read_probe(probe, token);
  const auto deadline = std::chrono::steady_clock::now() + kProbeWait;
  while (!mine.empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    mine = read_probe(probe, token);
  }
  agree.post("probe-seen", mine);
  const std::vector<std::string> seen = agree.gather("probe-seen");
  if (pg.rank() == 0) std::remove(probe.c_str());
  std::ostringstream blind;
  int count = 0;
  for (int r = 0; r < pg.size(); ++r)
    if (!seen[size_t(r)].empty()) blind << (count++ ? ", " : "") << pg.describe_peer(r) << " (" << seen[size_t(r)] << ")";
  if (count == 0) return "";
  std::ostringstream os;
  os << "fsdp: " << what << ": '" << shown_dir << "' is not one directory for all ranks: " << pg.describe_peer(0)
     << " wrote a probe file into '" << dir << "', but " << blind.str() << (count == 1 ? " does" : " do")
     << " not see it. Every rank writes its own files into the checkpoint directory and every rank reads them "
        "all when loading, so the directory must be on a file system shared by all nodes, mounted at the same "
        "path on each (NFS, Lustre, a cloud file share); nothing was saved";
  return os.str();
}

}  // namespace fsdp::state
