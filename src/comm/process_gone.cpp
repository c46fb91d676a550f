#include "process_gone.h"

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

namespace fsdp::comm::detail {

bool process_gone(pid_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0) return errno == ESRCH;  // EPERM: it exists, owned by someone else
  // /proc/<pid>/stat is "pid (comm) state ...": comm may hold spaces and parentheses,
  // so the state is the first field after the last ')'.
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return errno == ENOENT;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return false;
  const char state = close[2];
  return state == 'Z' || state == 'X';
}

}  // namespace fsdp::comm::detail
