#include "harness/multirank.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "comm/flight_exchange.h"
#include "harness/skips.h"
#include "harness/temp_dir.h"

extern char** environ;

namespace fsdp::testing {

namespace {

const char* kRankVar = "FSDP_TEST_RANK";
const char* kWorldVar = "FSDP_TEST_WORLD";
const char* kStoreVar = "FSDP_TEST_STORE";
const char* kCallVar = "FSDP_TEST_CALL";
const char* kThreadsVar = "FSDP_TEST_THREADS";
const char* kTimeoutVar = "FSDP_TEST_TIMEOUT_MS";

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// Index of the run_ranks call inside the current test, so that a test with
// several calls (say world sizes 2 and 3) runs each in its own set of workers.
int next_call_index() {
  static std::string test;
  static int index = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  if (name != test) {
    test = name;
    index = 0;
  }
  return index++;
}

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  TORCH_CHECK(info != nullptr, "run_ranks must be called from inside a TEST body");
  return std::string(info->test_suite_name()) + "." + info->name();
}

// The file a worker writes once its body has returned, so that the launcher can
// tell a rank that ran its body from one that exited 0 without running it (a
// gtest filter that matched no test, a call index that matched no call).
std::string ran_marker(const std::string& dir, int rank) { return dir + "/rank" + std::to_string(rank) + ".ran"; }
// The file a worker whose body skipped writes, holding the reason, so that the launcher can
// fail the test naming the rank ([Note: skips]: a skip is decided before run_ranks).
std::string skip_marker(const std::string& dir, int rank) { return dir + "/rank" + std::to_string(rank) + ".skipped"; }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string prefix_lines(const std::string& text, int rank) {
  std::stringstream in(text), out;
  std::string line;
  while (std::getline(in, line)) out << "[rank" << rank << "]: " << line << "\n";
  return out.str();
}

// Kills and reaps the ranks still running when run_ranks leaves early (a later
// spawn failed), so that none outlives the call or writes into its removed
// directory. After a normal run every rank is already reaped and this is a no-op.
struct ReapRanksOnExit {
  const std::vector<pid_t>& pids;
  const std::vector<bool>& done;
  ~ReapRanksOnExit() {
    for (size_t r = 0; r < pids.size(); ++r)
      if (pids[r] > 0 && !done[r]) kill(pids[r], SIGKILL);
    for (size_t r = 0; r < pids.size(); ++r) {
      int st = 0;
      if (pids[r] > 0 && !done[r]) waitpid(pids[r], &st, 0);
    }
  }
};

}  // namespace

bool is_worker() { return std::getenv(kRankVar) != nullptr; }

std::string worker_scratch_dir() {
  const char* store = std::getenv(kStoreVar);
  TORCH_CHECK(is_worker() && store != nullptr, "worker_scratch_dir() is for the body of run_ranks");
  const std::string path(store);
  return path.substr(0, path.rfind('/'));
}

void exit_worker_now() {
  TORCH_CHECK(is_worker(), "exit_worker_now() is for the body of run_ranks");
  std::ofstream(ran_marker(worker_scratch_dir(), env_int(kRankVar, 0))) << "ran\n";
  std::fflush(nullptr);
  ::_exit(0);
}

void configure_worker_process() {
  if (!is_worker()) return;
  at::set_num_threads(env_int(kThreadsVar, 1));
}

void run_case(const std::string& name, const std::function<void()>& body) {
  SCOPED_TRACE("case " + name);
  try {
    body();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "case " << name << " threw: " << e.what();
  }
}

comm::InitOptions worker_init_options() {
  TORCH_CHECK(is_worker(), "harness: worker_init_options() outside a rank worker");
  comm::LaunchOverrides ov;
  ov.rank = env_int(kRankVar, 0);
  ov.world_size = env_int(kWorldVar, 1);
  return comm::InitOptions()
      .file_store_path(std::getenv(kStoreVar))
      .timeout(std::chrono::milliseconds(env_int(kTimeoutVar, 60000)))
      .overrides(ov);
}

namespace {

// Every multi-rank test also checks that its ranks issued the same collectives on every group
// of its world (op, dtype, size, label at each sequence number: [Note: first divergence] in
// src/comm/divergence.h), so that a normal run never looks like a divergence to the flight
// recorder. Worlds with a planted failure (a failed record) are not compared, nor ranks that
// left early.
void expect_ranks_agreed(const comm::ProcessGroup& pg) {
  if (pg.size() < 2) return;
  const auto x = comm::detail::exchange_records(pg, "harness-end", std::chrono::seconds(20));
  if (!x.store_error.empty()) return;  // a test that took the store down
  for (const auto& rank : x.ranks) {
    if (!rank) continue;
    for (const auto& group : rank->groups)
      for (const auto& c : group.second.second)
        if (c.state == comm::detail::RecordState::kFailed) return;  // a planted failure
  }
  const auto lines = comm::detail::describe_groups(x, pg.name(), /*silent_too=*/false);
  for (const auto& line : lines) ADD_FAILURE() << "the ranks' collectives differ " << line;
}

}  // namespace

void run_ranks(int world_size, const std::function<void(comm::ProcessGroup&)>& body,
               const RankOptions& options) {
  const int call = next_call_index();
  if (is_worker()) {
    if (env_int(kCallVar, -1) != call) return;  // another call's workers
    TORCH_CHECK(env_int(kWorldVar, -1) == world_size, "harness: worker world size mismatch");
    auto opts = worker_init_options().backend(options.backend);
    try {
      auto pg = comm::init_process_group(opts);
      body(pg);
      const std::string skipped = skip_reason(*::testing::UnitTest::GetInstance()->current_test_info()->result());
      if (!skipped.empty()) {
        // The other ranks may be anywhere: no comparison of collectives, only the report.
        std::ofstream(skip_marker(worker_scratch_dir(), env_int(kRankVar, 0))) << skipped;
        ADD_FAILURE() << "rank " << env_int(kRankVar, 0) << " skipped inside the body of run_ranks (" << skipped
                      << "): decide a skip before run_ranks, in the parent test";
        return;
      }
      expect_ranks_agreed(pg);
      std::ofstream(ran_marker(worker_scratch_dir(), env_int(kRankVar, 0))) << "ran\n";
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << env_int(kRankVar, 0) << " threw: " << e.what();
    }
    return;
  }

  // The store and the ranks' logs; removed when this call returns, after every
  // rank has exited (run_dir is declared before reaper, so destroyed after it).
  const TempDir run_dir = TempDir::create("fsdp-test-");
  const std::string& dir = run_dir.path();
  const std::string store = dir + "/store";
  const std::string filter = "--gtest_filter=" + current_test_filter();

  std::vector<pid_t> pids(world_size, -1);
  std::vector<int> status(world_size, -1);
  std::vector<bool> done(world_size, false);
  const ReapRanksOnExit reaper{pids, done};
  std::vector<std::string> logs(world_size);
  for (int r = 0; r < world_size; ++r) {
    logs[r] = dir + "/rank" + std::to_string(r) + ".log";
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) {
      if (std::strncmp(*e, "FSDP_TEST_", 10) != 0) env_strings.emplace_back(*e);
    }
    env_strings.push_back(std::string(kRankVar) + "=" + std::to_string(r));
    env_strings.push_back(std::string(kWorldVar) + "=" + std::to_string(world_size));
    env_strings.push_back(std::string(kStoreVar) + "=" + store);
    env_strings.push_back(std::string(kCallVar) + "=" + std::to_string(call));
    env_strings.push_back(std::string(kThreadsVar) + "=" + std::to_string(options.threads_per_rank));
    env_strings.push_back(std::string(kTimeoutVar) + "=" +
                          std::to_string(options.collective_timeout.count()));
    env_strings.push_back("OMP_NUM_THREADS=" + std::to_string(options.threads_per_rank));
    // A variable of extra_env replaces one of the same name above (glibc's getenv would
    // return the first of two).
    for (const auto& kv : options.extra_env) {
      const std::string name = kv.substr(0, kv.find('=') + 1);  // "K=", or "" for a bare word
      if (name.empty()) continue;
      env_strings.erase(std::remove_if(env_strings.begin(), env_strings.end(),
                                       [&](const std::string& e) { return e.compare(0, name.size(), name) == 0; }),
                        env_strings.end());
    }
    for (const auto& kv : options.extra_env) env_strings.push_back(kv);
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    // The filter names exactly this test; the flag lets a DISABLED_ test that a caller ran on
    // purpose run in its workers too.
    std::string also_disabled = "--gtest_also_run_disabled_tests";
    std::vector<char*> argv{exe.data(), const_cast<char*>(filter.c_str()), also_disabled.data(), nullptr};

    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = -1;
    int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ASSERT_EQ(rc, 0) << "spawning rank " << r << " failed: " << std::strerror(rc);
    pids[r] = pid;
  }

  // Supervise: all ranks must exit 0 before the deadline. When one fails, the
  // others get a short grace period to report their own view, then are killed.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + options.deadline;
  int remaining = world_size;
  bool any_failed = false;
  std::chrono::steady_clock::time_point kill_at = deadline;
  std::string why;
  while (remaining > 0) {
    for (int r = 0; r < world_size; ++r) {
      if (done[r]) continue;
      int st = 0;
      pid_t got = waitpid(pids[r], &st, WNOHANG);
      if (got == pids[r]) {
        done[r] = true;
        status[r] = st;
        --remaining;
        if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0) && !any_failed) {
          any_failed = true;
          kill_at = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(10));
          why = "rank " + std::to_string(r) + " failed first";
        }
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() >= kill_at) {
      if (why.empty()) why = "deadline of " + std::to_string(options.deadline.count()) + " s passed";
      for (int r = 0; r < world_size; ++r)
        if (!done[r]) kill(pids[r], SIGKILL);
      for (int r = 0; r < world_size; ++r) {
        if (done[r]) continue;
        int st = 0;
        waitpid(pids[r], &st, 0);
        status[r] = st;
        done[r] = true;
      }
      any_failed = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  // A rank whose body skipped fails the test, whatever its exit status said.
  std::string skipped_ranks;
  for (int r = 0; r < world_size; ++r) {
    if (!std::ifstream(skip_marker(dir, r)).good()) continue;
    skipped_ranks += std::string(skipped_ranks.empty() ? "" : ", ") + "rank " + std::to_string(r) + " skipped (" +
                     read_file(skip_marker(dir, r)) + ")";
  }
  if (!skipped_ranks.empty()) {
    any_failed = true;
    why = skipped_ranks +
          " inside the body of run_ranks; skips must be decided before run_ranks, in the parent test, so that "
          "every rank agrees and ctest sees the skip";
  }

  // Every rank exited 0: each must also have run the body.
  if (!any_failed) {
    for (int r = 0; r < world_size; ++r) {
      if (std::ifstream(ran_marker(dir, r)).good()) continue;
      any_failed = true;
      why = "rank " + std::to_string(r) +
            " exited 0 without running the test body (its gtest filter or run_ranks call matched nothing)";
      break;
    }
  }

  if (any_failed) {
    std::ostringstream report;
    report << world_size << "-rank run failed (" << why << ")\n";
    for (int r = 0; r < world_size; ++r) {
      int st = status[r];
      report << "--- rank " << r << ": ";
      if (WIFEXITED(st)) report << "exit " << WEXITSTATUS(st);
      else if (WIFSIGNALED(st)) report << "signal " << WTERMSIG(st) << " (" << strsignal(WTERMSIG(st)) << ")";
      report << "\n" << prefix_lines(read_file(logs[r]), r);
    }
    ADD_FAILURE() << report.str();
  } else if (std::getenv("FSDP_TEST_VERBOSE")) {
    for (int r = 0; r < world_size; ++r) std::cout << prefix_lines(read_file(logs[r]), r);
  }
}

}  // namespace fsdp::testing
