// What fsdp::trainer::Trainer::fit() checks before any rank starts ([Note: trainer launch]):
// the fsdp-run it would re-execute under belongs to the library's own build (version and
// build id, fsdp-run --version), the installed bin directory comes first for a program
// compiled against the installed package, and a resume path that holds no checkpoint is
// refused in the launching process, before fsdp-run starts a rank.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <torch/torch.h>

#include "fsdp/trainer/launch.h"
#include "fsdp/trainer/trainer.h"
#include "harness/models.h"
#include "harness/temp_dir.h"

namespace fsdp::testing {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

/// An executable shell script `dir`/fsdp-run with body `body`.
std::string fake_launcher(const std::string& dir, const std::string& body) {
  const std::string path = dir + "/fsdp-run";
  std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
  ::chmod(path.c_str(), 0755);
  return path;
}

/// find_launcher's c10::Error message, or "" if it returned.
std::string find_launcher_error(const std::string& explicit_path, const std::string& installed_bindir = "") {
  try {
    trainer::find_launcher(explicit_path, installed_bindir);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(LauncherVersion, FsdpRunReportsTheLibrarysBuild) {
  const char* bin = std::getenv("FSDP_BIN_DIR");
  ASSERT_NE(bin, nullptr) << "run under ctest (FSDP_BIN_DIR)";
  const std::string want = trainer::launcher_version();
  EXPECT_EQ(want.rfind("fsdp-run ", 0), 0u) << want;
  EXPECT_NE(want.find(" (build "), std::string::npos) << want;
  FILE* p = ::popen((std::string(bin) + "/fsdp-run --version 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  char line[512] = {0};
  const bool got = std::fgets(line, sizeof line, p) != nullptr;
  const int status = ::pclose(p);
  ASSERT_TRUE(got);
  EXPECT_EQ(status, 0) << line;
  EXPECT_EQ(std::string(line), want + "\n");
}

TEST(LauncherVersion, AnotherBuildIsRefusedByName) {
  const TempDir dir = TempDir::create("fsdp-launcher-");
  const std::string other = fake_launcher(dir.path(), "echo 'fsdp-run 0.0.9 (build 0123456789ab)'");
  const std::string msg = find_launcher_error(other);
  EXPECT_NE(msg.find("fsdp-run at " + other + " is version 0.0.9 (build 0123456789ab), but this program was built "
                     "with fsdp "),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find(trainer::launcher_version().substr(9)), std::string::npos) << "our version and build: " << msg;
  EXPECT_NE(msg.find("TrainerOptions::launcher"), std::string::npos) << "the fix: " << msg;

  // An fsdp-run from before --version existed refuses the option (exit 2, on stderr).
  fake_launcher(dir.path(), "echo \"fsdp-run: unknown option '$1'\" >&2; exit 2");
  const std::string old = find_launcher_error(other);
  EXPECT_NE(old.find("fsdp-run at " + other + " is of an older build (it does not answer --version)"),
            std::string::npos)
      << old;

  // The same build's is accepted.
  fake_launcher(dir.path(), "echo '" + trainer::launcher_version() + "'");
  EXPECT_EQ(find_launcher_error(other), "");
}

TEST(LauncherVersion, InstalledBinDirectoryFirst) {
  const std::string self = self_exe();
  const std::string beside = self.substr(0, self.rfind('/')) + "/fsdp-run";
  ASSERT_EQ(::access(beside.c_str(), X_OK), 0) << "build fsdp-run: it lands beside the tests, in " << beside;
  // Compiled against the build tree: the fsdp-run beside the program (the build's own).
  EXPECT_EQ(trainer::find_launcher("", ""), beside);
  // Compiled against an installed package: its bin directory first, although one is beside.
  const TempDir installed = TempDir::create("fsdp-installed-bin-");
  const std::string mine = fake_launcher(installed.path(), "echo '" + trainer::launcher_version() + "'");
  EXPECT_EQ(trainer::find_launcher("", installed.path()), mine);
  // An installed fsdp-run of another build is refused, not passed over for the one beside.
  fake_launcher(installed.path(), "echo 'fsdp-run 0.1.0 (build feedfeedfeed)'");
  EXPECT_NE(find_launcher_error("", installed.path()).find("fsdp-run at " + mine + " is version 0.1.0 (build "
                                                           "feedfeedfeed)"),
            std::string::npos);
}

/// (x [13], y [5]) pairs.
class Pairs : public torch::data::datasets::Dataset<Pairs> {
 public:
  torch::data::Example<> get(size_t i) override { return {torch::full({13}, double(i)), torch::zeros({5})}; }
  torch::optional<size_t> size() const override { return 12; }
};

using TT = trainer::Trainer<TinyTransformerImpl>;

TT pairs_trainer(trainer::TrainerOptions o) {
  TT t(o.progress(false).memory_summary(false).global_batch_size(4).max_steps(2));
  t.model([] { return TinyTransformer(13, 24, 5, 2); })
      .optimizer([](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
      })
      .train_data(Pairs())
      .training_step([](TT::Model& m, torch::data::Example<>& b) { return torch::mse_loss(m.forward(b.data), b.target); });
  return t;
}

// Started by MissingResumePathRefusedBeforeRanksStart as a plain process (no launcher
// variables). fit() must refuse before it re-executes under fsdp-run; had it not, each
// rank would run this again under the launcher and fail later, in its load.
TEST(TrainerLaunch, DISABLED_ResumeChild) {
  const char* out = std::getenv("FSDP_TRAINER_LAUNCH_OUT");
  ASSERT_NE(out, nullptr);
  TT t = pairs_trainer(trainer::TrainerOptions().devices(2).resume(std::string(out) + "/ckpt/step-9"));
  try {
    t.fit();
    std::ofstream(std::string(out) + "/fit_returned.txt") << std::getenv("RANK");
  } catch (const c10::Error& e) {
    std::ofstream(std::string(out) + (trainer::under_launcher() ? "/rank_error.txt" : "/error.txt"))
        << e.what_without_backtrace();
  }
}

TEST(TrainerLaunch, MissingResumePathRefusedBeforeRanksStart) {
  if (trainer::under_launcher()) GTEST_SKIP() << "this test process runs under a launcher";
  const TempDir dir = TempDir::create("fsdp-trainer-resume-");
  const std::string want = "fsdp::Trainer: resume '" + dir.path() + "/ckpt/step-9': no checkpoint there (cannot read " +
                           dir.path() + "/ckpt/step-9/metadata.json); name a checkpoint directory that exists";
  // One device trains in this process: refused before the process group exists.
  {
    TT t = pairs_trainer(trainer::TrainerOptions().resume(dir.path() + "/ckpt/step-9"));
    try {
      t.fit();
      ADD_FAILURE() << "a resume path without a checkpoint was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(want), std::string::npos) << e.what_without_backtrace();
    }
  }
  // Two devices: refused in the process that would start the ranks, and none starts.
  const std::string cmd = "env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK FSDP_TRAINER_LAUNCH_OUT=" +
                          dir.path() + " " + self_exe() +
                          " --gtest_also_run_disabled_tests --gtest_filter=TrainerLaunch.DISABLED_ResumeChild > " +
                          dir.path() + "/log.txt 2>&1";
  const int status = std::system(cmd.c_str());
  const std::string log = read_file(dir.path() + "/log.txt");
  EXPECT_EQ(status, 0) << log;
  EXPECT_NE(read_file(dir.path() + "/error.txt").find(want), std::string::npos)
      << "error.txt: " << read_file(dir.path() + "/error.txt") << "\nlog:\n" << log;
  EXPECT_EQ(log.find("[rank"), std::string::npos) << "ranks were started:\n" << log;
  EXPECT_EQ(read_file(dir.path() + "/rank_error.txt"), "");
}

}  // namespace
}  // namespace fsdp::testing
