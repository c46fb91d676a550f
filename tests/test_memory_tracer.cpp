// Memory tracer (include/fsdp/core/memory_tracer.h) at N=2: which samples are
// taken (every unit's four boundaries once per step, one per optimizer step),
// and their categories against closed forms computed from the model's shapes:
// parameter shards = sum over units of padded_numel / N x 4 B, Adam state = 2 x
// this rank's piece bytes after the first step, gradients = piece bytes, a unit
// gathered for forward holds at least its padded flat buffer, and the allocator
// (counting enabled before the model is built) holds at least the categories.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <fstream>
#include <map>
#include <set>
#include <tuple>
#include <string>

#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/memory_tracer.h"
#include "harness/gpu.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using fsdp::testing::run_case;
using fsdp::testing::run_ranks;

namespace {

void tracer_cases(comm::ProcessGroup& pg) {
  memory::enable_allocator_counting();
  run_case("samples and categories", [&] {
    const int n = pg.size();
    std::map<std::string, int64_t> numel_of;  // full sizes, by name
    {
      auto reference = fsdp::testing::make_transformer(0);
      for (const auto& p : reference->named_parameters()) numel_of[p.key()] = p.value().numel();
    }
    auto model = FullyShardedDataParallel(fsdp::testing::make_transformer(0), pg,
                                          Options().auto_wrap_policy(always_wrap_policy()));
    const auto paths = model->unit_paths();
    std::map<std::string, int64_t> padded_bytes;  // by unit path
    int64_t shard_bytes = 0;
    for (size_t i = 0; i < paths.size(); ++i) {
      int64_t numel = 0;
      for (const auto& name : model->unit_parameter_names(i)) numel += numel_of.at(name);
      padded_bytes[paths[i]] = comm::padded_numel(numel, n) * 4;
      shard_bytes += comm::padded_numel(numel, n) / n * 4;
    }
    int64_t piece_bytes = 0;
    for (const auto& p : model->parameters()) piece_bytes += p.numel() * 4;

    torch::optim::Adam opt(model->parameters(), 1e-3);
    MemoryTracer tracer(*model, &opt);
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = fsdp::testing::global_batch(step, 8);
      opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(model->forward(fsdp::testing::rank_slice(x, pg.rank(), n)),
                      fsdp::testing::rank_slice(y, pg.rank(), n))
          .backward();
      opt.step();
      tracer.step();
    }

    std::map<std::tuple<int64_t, std::string, std::string>, int> count;
    for (const auto& m : tracer.samples()) {
      ++count[{m.step, m.unit, m.phase}];
      const auto& u = m.usage;
      EXPECT_EQ(u[MemoryCategory::kParameterShards], shard_bytes) << m.unit << " " << m.phase;
      EXPECT_GE(m.allocator_bytes, u.total() - u[MemoryCategory::kOther]) << m.unit << " " << m.phase;
      EXPECT_EQ(m.cuda.allocated, -1) << "a CPU model's sample holds no CUDA statistics";
      if (m.phase == "pre_forward" || m.phase == "pre_backward") {
        EXPECT_GE(u[MemoryCategory::kUnshardedParameters], padded_bytes.at(m.unit)) << m.unit << " " << m.phase;
      }
      if (m.phase == "optimizer_step") {
        EXPECT_EQ(u[MemoryCategory::kOptimizerState], 2 * piece_bytes) << "step " << m.step;
        EXPECT_EQ(u[MemoryCategory::kGradients], piece_bytes) << "step " << m.step;
      } else if (m.step == 0) {
        EXPECT_EQ(u[MemoryCategory::kOptimizerState], 0) << m.unit << " " << m.phase;
      }
    }
    for (int64_t step = 0; step < 2; ++step) {
      EXPECT_EQ((count[{step, "-", "optimizer_step"}]), 1) << step;
      for (const auto& path : paths)
        for (const char* phase : {"pre_forward", "post_forward", "pre_backward", "post_backward"})
          EXPECT_EQ((count[{step, path, phase}]), 1) << "step " << step << " unit '" << path << "' " << phase;
    }
    EXPECT_EQ(tracer.samples().size(), 2 * (4 * paths.size() + 1));

    const std::string file = fsdp::testing::worker_scratch_dir() + "/memory_rank" + std::to_string(pg.rank()) + ".jsonl";
    EXPECT_EQ(dump_memory_stats(file), static_cast<int64_t>(tracer.samples().size()));
    std::ifstream in(file);
    std::string line;
    int64_t lines = 0;
    while (std::getline(in, line)) {
      if (lines++ == 0) {
        for (const char* key : {"\"phase\":\"pre_forward\"", "\"unit\":\"\"", "\"parameter_shards\":",
                                "\"optimizer_state\":", "\"other\":", "\"step\":0"})
          EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
        EXPECT_EQ(line.find("\"cuda\""), std::string::npos) << line;
      }
    }
    EXPECT_EQ(lines, static_cast<int64_t>(tracer.samples().size()));
  });
}

// A model on the rank's GPU: every sample holds the CUDA caching allocator's statistics of
// that device (allocated >= the parameter shards, which live there; reserved >= allocated;
// peak >= allocated), "other" is what that allocator holds beyond the categories, and the
// dump carries them under "cuda". A CPU model's samples hold -1s and no "cuda" key.
void cuda_tracer_case(comm::ProcessGroup& pg) {
  ASSERT_GE(pg.cuda_device(), 0) << "the process group moves no CUDA tensors";
  const torch::Device device(torch::kCUDA, pg.cuda_device());
  auto net = fsdp::testing::make_transformer(0);
  net->to(device);
  auto model = FullyShardedDataParallel(net, pg, Options().auto_wrap_policy(always_wrap_policy()));
  torch::optim::Adam opt(model->parameters(), 1e-3);
  MemoryTracer tracer(*model, &opt);
  auto [x, y] = fsdp::testing::global_batch(0, 8);
  torch::mse_loss(model->forward(fsdp::testing::rank_slice(x, pg.rank(), pg.size()).to(device)),
                  fsdp::testing::rank_slice(y, pg.rank(), pg.size()).to(device))
      .backward();
  opt.step();
  tracer.step();
  ASSERT_FALSE(tracer.samples().empty());
  for (const auto& m : tracer.samples()) {
    EXPECT_GE(m.cuda.allocated, m.usage[MemoryCategory::kParameterShards]) << m.unit << " " << m.phase;
    EXPECT_GE(m.cuda.reserved, m.cuda.allocated) << m.unit << " " << m.phase;
    EXPECT_GE(m.cuda.peak_allocated, m.cuda.allocated) << m.unit << " " << m.phase;
    EXPECT_EQ(m.usage.total(), std::max(m.cuda.allocated, m.usage.total() - m.usage[MemoryCategory::kOther]))
        << "other is the allocator's bytes beyond the categories: " << m.unit << " " << m.phase;
  }
  const std::string file = fsdp::testing::worker_scratch_dir() + "/cuda_rank" + std::to_string(pg.rank()) + ".jsonl";
  tracer.dump(file);
  std::ifstream in(file);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  for (const char* key : {"\"cuda\":", "\"allocated_bytes\":", "\"reserved_bytes\":", "\"peak_allocated_bytes\":"})
    EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
}

}  // namespace

TEST(MemoryTracer, SamplesUnitBoundaries) { run_ranks(2, tracer_cases); }

TEST(MemoryTracerCuda, ReportsTheCachingAllocatorOfTheModelsDevice) {
  FSDP_SKIP_WITHOUT_GPU(1);
  run_ranks(1, cuda_tracer_case);
}
