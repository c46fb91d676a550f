// The "re-execute myself under fsdp-run" part of the benchmarks that start their own
// ranks: started without RANK in the environment, bench_collectives and bench_strategies
// run `<bin>/fsdp-run --nproc N -- <self> args...` and read what rank 0 prints.
// Header-only: benchmarks link the library, not each other.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "common/tool_error.h"

namespace fsdp {
namespace bench {

/// The median of `v` (the mean of the middle two for an even count); `v` not empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

/// Path of the running executable (/proc/self/exe), or `fallback` if it cannot be read.
inline std::string self_exe(const std::string& fallback) {
  char buf[4096];
  ssize_t len = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return len > 0 ? std::string(buf, static_cast<size_t>(len)) : fallback;
}

/// The fsdp-run that sits in the same directory as `exe`.
inline std::string launcher_next_to(const std::string& exe) {
  return exe.substr(0, exe.rfind('/') + 1) + "fsdp-run";
}

/// Replaces this process with `fsdp-run --nproc N -- <self> args...` (the fsdp-run next to
/// this binary), for a benchmark whose ranks print their own results. Returns 1 only when
/// that fails, having said why on stderr.
inline int exec_under_launcher(const char* name, int nproc, const std::vector<std::string>& args) {
  const std::string self = self_exe(name);
  const std::string launcher = launcher_next_to(self);
  std::vector<std::string> argv{launcher, "--nproc", std::to_string(nproc), "--", self};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> c;
  for (auto& a : argv) c.push_back(a.data());
  c.push_back(nullptr);
  ::execv(launcher.c_str(), c.data());
  std::fprintf(stderr, "%s: cannot execute %s: %s (build the target fsdp-run)\n", name, launcher.c_str(),
               std::strerror(errno));
  return 1;
}

/// `s` single-quoted for the shell.
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

/// Runs `cmd` through the shell and hands every line it prints on stdout to `on_line`
/// (without the newline; rank 0's "[rank0]: " prefix removed, other ranks' lines as
/// they are). Returns the command's exit code, 128 + signal if a signal ended it, or
/// -1 if it could not be started.
inline int run_lines(const std::string& cmd, const std::function<void(const std::string&)>& on_line) {
  std::fflush(nullptr);
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return -1;
  const std::string prefix = "[rank0]: ";
  char* line = nullptr;
  size_t cap = 0;
  while (::getline(&line, &cap, p) > 0) {
    std::string s = line;
    if (s.rfind(prefix, 0) == 0) s = s.substr(prefix.size());
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    on_line(s);
  }
  std::free(line);
  const int status = ::pclose(p);
  if (status == -1) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

/// The JSON lines ("{...}") that `cmd` printed on stdout (rank 0's, prefix removed); a
/// non-zero exit is reported on stderr as "<who>: '<cmd>' exited with status <code>".
inline std::vector<std::string> json_lines(const std::string& cmd, const char* who) {
  std::vector<std::string> out;
  const int rc = run_lines(cmd, [&](const std::string& s) {
    if (!s.empty() && s.front() == '{') out.push_back(s);
  });
  if (rc != 0) std::fprintf(stderr, "%s: '%s' exited with status %d\n", who, cmd.c_str(), rc);
  return out;
}

/// A benchmark's flags: integers with their least value, strings, and switches.
struct IntFlag {
  const char* flag;
  int* value;
  int least;
};
struct StringFlag {
  const char* flag;
  std::string* value;
};
struct Switch {
  const char* flag;
  bool* value;
};

/// Parses argv[1..] into the flags given: -h/--help prints `usage` on stdout and exits 0; an
/// unknown argument, a missing value or an integer below its least exits 2, saying which on
/// stderr as "<name>: ..." followed by `usage`.
inline void parse_flags(const char* name, const char* usage, int argc, char** argv, const std::vector<IntFlag>& ints,
                        const std::vector<StringFlag>& strings = {}, const std::vector<Switch>& switches = {}) {
  auto fail = [&](const std::string& what) {
    fsdp::tools::print_error(name, what + "\n" + usage);
    std::exit(2);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    const auto sw = std::find_if(switches.begin(), switches.end(), [&](const Switch& s) { return flag == s.flag; });
    if (sw != switches.end()) {
      *sw->value = true;
      continue;
    }
    const auto in = std::find_if(ints.begin(), ints.end(), [&](const IntFlag& f) { return flag == f.flag; });
    const auto st = std::find_if(strings.begin(), strings.end(), [&](const StringFlag& f) { return flag == f.flag; });
    if (in == ints.end() && st == strings.end()) fail("unknown argument '" + flag + "'");
    if (i + 1 >= argc) fail(flag + " needs a value");
    const std::string v = argv[++i];
    if (st != strings.end()) {
      *st->value = v;
      continue;
    }
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || n < in->least)
      fail(flag + " expects an integer >= " + std::to_string(in->least) + ", got '" + v + "'");
    *in->value = static_cast<int>(n);
  }
}

/// main() of a benchmark that starts its own ranks: without RANK in the environment it
/// runs `launcher` (which re-executes the binary under fsdp-run), under a launcher it
/// runs `rank`; an exception there is reported as "<name>: FAILED: ..." (no C++
/// backtrace, tools/common/tool_error.h) with status 1.
template <typename Args>
int launcher_or_rank_main(const char* name, const Args& args, int (*launcher)(const Args&),
                          int (*rank)(const Args&)) {
  if (std::getenv("RANK") == nullptr) return launcher(args);
  try {
    return rank(args);
  } catch (const c10::Error& e) {
    fsdp::tools::print_exception(name, e, "FAILED: ");
    return 1;
  } catch (const std::exception& e) {
    fsdp::tools::print_exception(name, e, "FAILED: ");
    return 1;
  }
}

}  // namespace bench
}  // namespace fsdp
