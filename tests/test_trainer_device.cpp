// fsdp::trainer::Trainer on a device (TrainerOptions::device) and checkpoints that cross
// devices.
//
// Runs everywhere (TrainerDevice.*, no "Cuda" in their names): the option's checks (an
// unknown word, a batch type the Trainer cannot move, "cuda" on a machine without a GPU,
// in a worker that sees none on a GPU machine too).
// GPU cases (TrainerDeviceCuda.*, ctest entry test_trainer_device_cuda, label gpu; they skip
// without a GPU, saying so):
//  * a short fit on the rank's GPU against the same fit on the CPU in the same process, at
//    N=1 (NCCL) and N=2 (two ranks sharing the GPU: Gloo on CUDA), FULL_SHARD and ZERO2,
//    Adam: every step's loss and the final parameters within kCudaTolerance;
//  * a checkpoint round trip through the Trainer: saved by GPU ranks, resumed on CPU ranks,
//    and the other way round. Loading copies bytes, so the resumed run starts from exactly
//    the saved parameters; its later losses follow the uninterrupted run within the same
//    tolerance (the two devices round differently). Records are staged to the host in
//    64-byte chunks here (set_checkpoint_staging_chunk_bytes), so each crosses many.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "fsdp/state/summon_full_params.h"
#include "fsdp/trainer/trainer.h"
#include "harness/gpu.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/regression_set.h"
#include "harness/test_dir.h"
#include "state/checkpoint_testing.h"

namespace fsdp::testing {
namespace {

using trainer::Callback;
using trainer::FitResult;
using trainer::Strategy;
using trainer::StrategyKind;
using trainer::Trainer;
using trainer::TrainerOptions;
using Params = std::map<std::string, torch::Tensor>;

constexpr int64_t kSamples = 24, kBatch = 6;

// fp32 on a GPU against fp32 on the CPU: the same operations, summed in other orders (cuBLAS
// against MKL/oneDNN; NCCL or Gloo on CUDA against shared memory), TF32 off (libtorch's
// default for matmuls). Over 4 Adam steps of this model the differences are rounding:
// bounded here at 1e-4, relative for losses and absolute for parameters (|p| ~ 0.1-1).
constexpr double kCudaTolerance = 1e-4;

using TT = Trainer<TinyTransformerImpl>;

Strategy by_block(StrategyKind kind) {
  return Strategy(kind).fsdp(fsdp::Options().auto_wrap_policy(module_type_policy<BlockImpl>()));
}

/// A Trainer of TinyTransformer on RegressionSet with mean MSE and Adam on `device`.
TT make_trainer(const std::string& device, StrategyKind kind, int64_t steps = 4) {
  TT t(TrainerOptions()
           .device(device)
           .strategy(by_block(kind))
           .global_batch_size(kBatch)
           .max_steps(steps)
           .seed(3)
           .progress(false)
           .memory_summary(false));
  t.model([] { return TinyTransformer(13, 24, 5, 2); })
      .optimizer([](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2));
      })
      .train_data(RegressionSet(kSamples, /*seed=*/5))
      .training_step([device](TT::Model& model, torch::data::Example<>& b) {
        EXPECT_EQ(b.data.device().type(), device == "cuda" ? torch::kCUDA : torch::kCPU);
        return torch::mse_loss(model.forward(b.data), b.target);
      });
  return t;
}

/// Full parameters by name on the CPU (collective): FSDP's inside apply_with_full_params,
/// ZeRO's the module's own (fp32: the partition owners broadcast them after each step).
Params full_parameters(TT::Model& m) {
  Params out;
  auto grab = [&](torch::nn::Module& mod) {
    for (const auto& p : mod.named_parameters()) out[p.key()] = p.value().detach().cpu().clone();
  };
  if (m.fsdp()) fsdp::apply_with_full_params(*m.fsdp(), grab);
  else grab(*m.module());
  return out;
}

/// Records the full parameters when training starts (after a resume's load).
struct StartRecorder : Callback {
  explicit StartRecorder(TT* t) : trainer(t) {}
  void on_train_start(const trainer::TrainStart&) override { start = full_parameters(*trainer->trained_model()); }
  TT* trainer;
  Params start;
};

void expect_near(const Params& a, const Params& b, double tol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    const double diff = (t - b.at(name)).abs().max().item<double>();
    EXPECT_LE(diff, tol) << what << ": parameter " << name << " differs by " << diff;
  }
}

void expect_losses_near(const std::vector<double>& a, const std::vector<double>& b, size_t offset,
                        const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], kCudaTolerance * std::abs(b[i])) << what << ": step " << i + offset + 1;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

// --- everywhere ------------------------------------------------------------------

TEST(TrainerDevice, UnknownDeviceAndUnmovableBatchAreNamed) {
  trainer::TrainerParts parts;
  parts.model = parts.optimizer = parts.training_step = parts.train_data = true;
  parts.train_size = kSamples;
  EXPECT_EQ(trainer::trainer_options_error(TrainerOptions(), parts, 2), "");
  EXPECT_EQ(trainer::trainer_options_error(TrainerOptions().device("cuda"), parts, 2), "")
      << "the word is known; whether this machine has a GPU is device_error's";
  const std::string unknown = trainer::trainer_options_error(TrainerOptions().device("gpu"), parts, 2);
  EXPECT_NE(unknown.find("unknown device 'gpu'; use \"cpu\" or \"cuda\""), std::string::npos) << unknown;
  EXPECT_NE(trainer::device_error(TrainerOptions().device("cuda:1")).find("unknown device 'cuda:1'"),
            std::string::npos);
  EXPECT_EQ(trainer::device_error(TrainerOptions()), "");
  parts.batch_to_device = false;  // a Batch type of its own, no batch_to_device
  EXPECT_EQ(trainer::trainer_options_error(TrainerOptions(), parts, 2), "") << "the CPU moves nothing";
  const std::string unmovable = trainer::trainer_options_error(TrainerOptions().device("cuda"), parts, 2);
  EXPECT_NE(unmovable.find("give Trainer::batch_to_device(fn)"), std::string::npos) << unmovable;
}

// In a one-rank worker whose CUDA sees no device (CUDA_VISIBLE_DEVICES empty), so that a GPU
// machine checks the GPU-less error too instead of skipping it. The worker's process group
// is not used.
TEST(TrainerDevice, GpuWordWithoutAGpuSaysSoBeforeAnyRankStarts) {
  RankOptions o;
  o.extra_env.push_back("CUDA_VISIBLE_DEVICES=");
  run_ranks(1, [](comm::ProcessGroup&) {
    ASSERT_FALSE(torch::cuda::is_available()) << "CUDA_VISIBLE_DEVICES= left a device visible";
    const std::string want = "device \"cuda\" but torch sees no CUDA device on this machine";
    const std::string direct = trainer::device_error(TrainerOptions().device("cuda"));
    EXPECT_NE(direct.find(want), std::string::npos) << direct;
    EXPECT_NE(direct.find("use device(\"cpu\")"), std::string::npos) << direct;
    // fit() without a launcher asks before it makes a process group or starts a rank.
    TT t = make_trainer("cuda", StrategyKind::kFullShard);
    const std::string msg = error_of([&] { t.fit(); });
    EXPECT_NE(msg.find("fsdp::Trainer: " + want), std::string::npos) << msg;
    EXPECT_EQ(t.trained_model(), nullptr) << "a model was built";
  }, o);
}

// --- on a GPU (label gpu) ------------------------------------------------------------

void fit_matches_cpu(comm::ProcessGroup& pg) {
  for (StrategyKind kind : {StrategyKind::kFullShard, StrategyKind::kZero2}) {
    run_case(std::string(trainer::to_string(kind)) + " at N=" + std::to_string(pg.size()), [&] {
      ASSERT_GE(pg.cuda_device(), 0) << "the process group moves no CUDA tensors";
      TT cpu = make_trainer("cpu", kind);
      const FitResult a = cpu.fit(pg);
      const Params final_cpu = full_parameters(*cpu.trained_model());
      TT gpu = make_trainer("cuda", kind);
      const FitResult b = gpu.fit(pg);
      for (const auto& p : gpu.trained_model()->module()->parameters())
        EXPECT_EQ(p.device(), torch::Device(torch::kCUDA, pg.cuda_device()));
      ASSERT_EQ(b.losses.size(), 4u);
      expect_losses_near(b.losses, a.losses, 0, "cuda against cpu");
      expect_near(full_parameters(*gpu.trained_model()), final_cpu, kCudaTolerance, "final parameters");
    });
  }
}

TEST(TrainerDeviceCuda, FitMatchesCpuAtOneRank) {
  FSDP_SKIP_WITHOUT_GPU(1);
  run_ranks(1, fit_matches_cpu, rank_options());
}

TEST(TrainerDeviceCuda, FitMatchesCpuAtTwoRanksOnOneGpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  run_ranks(2, fit_matches_cpu, rank_options());
}

/// A run on `from` with checkpoints at steps 2 and 4, then runs on `to` resumed from its
/// step-2: they start from exactly its parameters and continue it within the tolerance.
void round_trip(comm::ProcessGroup& pg, StrategyKind kind, const std::string& from, const std::string& to) {
  const std::string dir = test_dir() + "/" + trainer::to_string(kind) + "_" + from + "_to_" + to + "_n" +
                          std::to_string(pg.size());
  TT first = make_trainer(from, kind);
  first.options().checkpoint_dir(dir).checkpoint_interval(2).keep_checkpoints(0);
  struct AtStep2 : Callback {
    explicit AtStep2(TT* t) : trainer(t) {}
    void on_step_end(const trainer::StepMetrics& m) override {
      if (m.step == 2) params = full_parameters(*trainer->trained_model());
    }
    TT* trainer;
    Params params;
  };
  auto at2 = std::make_shared<AtStep2>(&first);
  first.callback(at2);
  const FitResult a = first.fit(pg);
  ASSERT_EQ(a.losses.size(), 4u);

  TT second = make_trainer(to, kind);
  second.options().resume(dir + "/step-2");
  auto start = std::make_shared<StartRecorder>(&second);
  second.callback(start);
  const FitResult b = second.fit(pg);
  EXPECT_EQ(b.first_step, 2);
  ASSERT_EQ(b.losses.size(), 2u);
  ASSERT_FALSE(at2->params.empty());
  for (const auto& [name, t] : at2->params)
    EXPECT_TRUE(torch::equal(start->start.at(name), t)) << from << " -> " << to << ": " << name
                                                        << " is not the saved value";
  expect_losses_near(b.losses, std::vector<double>(a.losses.begin() + 2, a.losses.end()), 2, from + " -> " + to);
  for (const auto& p : second.trained_model()->module()->parameters())
    EXPECT_EQ(p.device().type(), to == "cuda" ? torch::kCUDA : torch::kCPU);
}

void round_trips(comm::ProcessGroup& pg) {
  fsdp::state::detail::set_checkpoint_staging_chunk_bytes(64);
  for (StrategyKind kind : {StrategyKind::kFullShard, StrategyKind::kZero2}) {
    const std::string name = std::string(trainer::to_string(kind)) + " at N=" + std::to_string(pg.size());
    run_case(name + ": saved on GPUs, resumed on CPUs", [&] { round_trip(pg, kind, "cuda", "cpu"); });
    run_case(name + ": saved on CPUs, resumed on GPUs", [&] { round_trip(pg, kind, "cpu", "cuda"); });
  }
  fsdp::state::detail::set_checkpoint_staging_chunk_bytes(0);
}

TEST(TrainerDeviceCuda, CheckpointRoundTripGpuCpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  run_ranks(1, round_trips, rank_options());
  run_ranks(2, round_trips, rank_options());
}

}  // namespace
}  // namespace fsdp::testing
