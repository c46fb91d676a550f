// What fsdp::trainer::Trainer::fit() checks before any rank starts ([Note: trainer launch]):
// a resume path that holds no checkpoint is refused in the launching process, before
// fsdp-run starts a rank.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <torch/torch.h>

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
