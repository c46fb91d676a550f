// What fsdp::trainer::Trainer says while it trains, where a user would otherwise be left
// guessing: a sample of the wrong shape is named by its dataset index, with the rank and the
// step; rank 0 says each checkpoint keep_checkpoints deletes, and that a resumed run appends
// to the metrics file.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include <torch/torch.h>

#include "fsdp/trainer/trainer.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/test_dir.h"

namespace fsdp::testing {
namespace {

using TT = trainer::Trainer<TinyTransformerImpl>;

/// 12 (x [13], y [5]) pairs; the samples at `odd` have x of shape [14] instead.
class Pairs : public torch::data::datasets::Dataset<Pairs> {
 public:
  explicit Pairs(std::vector<size_t> odd = {}) : odd_(std::move(odd)) {}
  torch::data::Example<> get(size_t i) override {
    const bool is_odd = std::find(odd_.begin(), odd_.end(), i) != odd_.end();
    return {torch::full({is_odd ? 14 : 13}, 0.1 * double(i)), torch::full({5}, 0.05 * double(i))};
  }
  torch::optional<size_t> size() const override { return 12; }

 private:
  std::vector<size_t> odd_;
};

TT pairs_trainer(trainer::TrainerOptions o, Pairs data = Pairs()) {
  TT t(o.progress(false).memory_summary(false).global_batch_size(4).shuffle(false));
  t.model([] { return TinyTransformer(13, 24, 5, 2); })
      .optimizer([](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
      })
      .train_data(std::move(data))
      .training_step([](TT::Model& m, torch::data::Example<>& b) { return torch::mse_loss(m.forward(b.data), b.target); });
  return t;
}

// Global batches of 4 in order: step 2 holds samples 4..7, rank 0 collates 4 and 5, rank 1
// 6 and 7. Samples 5 and 7 are odd, so each rank fails collating its part of step 2, before
// any collective of that step: each names its own sample.
TEST(TrainerMessages, BadSampleNamesDatasetIndexRankAndStep) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    TT t = pairs_trainer(trainer::TrainerOptions().max_steps(3), Pairs({5, 7}));
    const int odd = pg.rank() == 0 ? 5 : 7;
    try {
      t.fit(pg);
      ADD_FAILURE() << "a sample of another shape was stacked";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("the training set's samples do not stack into a batch: dataset index " + std::to_string(odd) +
                         " has data of shape [14] where dataset index " + std::to_string(odd - 1) +
                         " (the batch's first) has [13]"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("fsdp::Trainer (rank " + std::to_string(pg.rank()) + "): training step 2 of 3"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("collate function that pads"), std::string::npos) << "the fix: " << msg;
    }
  }, rank_options(std::chrono::seconds(120)));
}

TEST(TrainerMessages, KeepCheckpointsSaysWhatItDeletesAndResumeThatItAppends) {
  run_ranks(1, [](comm::ProcessGroup& pg) {
    const std::string ckpt = test_dir() + "/keep";
    const std::string metrics = test_dir() + "/metrics.jsonl";
    auto options = [&] {
      return trainer::TrainerOptions().checkpoint_dir(ckpt).checkpoint_interval(1).keep_checkpoints(2).metrics_file(
          metrics);
    };
    ::testing::internal::CaptureStderr();
    TT first = pairs_trainer(options().max_steps(4));
    first.fit(pg);
    std::string said = ::testing::internal::GetCapturedStderr();
    // Saved step-1..4; step-1 goes with the third save, step-2 with the fourth.
    for (int gone : {1, 2}) {
      EXPECT_NE(said.find("fsdp::Trainer: deleted checkpoint " + ckpt + "/step-" + std::to_string(gone) +
                          ": keep_checkpoints 2 keeps only the newest"),
                std::string::npos)
          << said;
      EXPECT_FALSE(std::filesystem::exists(ckpt + "/step-" + std::to_string(gone)));
    }
    EXPECT_EQ(said.find("step-3:"), std::string::npos) << "kept, but said deleted:\n" << said;
    EXPECT_EQ(said.find("appending"), std::string::npos) << "a fresh run truncates the metrics file:\n" << said;

    ::testing::internal::CaptureStderr();
    TT resumed = pairs_trainer(options().max_steps(6).resume(ckpt + "/step-4"));
    resumed.fit(pg);
    said = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(said.find("fsdp::Trainer: resumed at step 4: appending to the metrics file " + metrics +
                        " (its lines up to step 4 stay"),
              std::string::npos)
        << said;
    std::ifstream f(metrics);
    int lines = 0;
    for (std::string line; std::getline(f, line);) ++lines;
    EXPECT_EQ(lines, 6) << "steps 1-4 of the first run and 5-6 of the resumed one";
  }, rank_options(std::chrono::seconds(120)));
}

}  // namespace
}  // namespace fsdp::testing
