// CUDA tensors through fsdp::comm (ctest label gpu; scripts/gpu_check.sh runs it on a GPU
// machine). Every case skips, saying why, where no CUDA device is visible. NCCL at one rank
// (NCCL refuses two ranks on one GPU, and the GPU machine has one), Gloo for two ranks on one
// GPU, and the refusal of NCCL for ranks that share a GPU: values against closed forms, the
// path each call took, and the labels the choke point saw.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "comm/collective_call.h"
#include "fsdp/comm/collectives.h"
#include "harness/multirank.h"
#include "harness/gpu.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

torch::TensorOptions on_gpu(const comm::ProcessGroup& pg, at::ScalarType dtype = at::kFloat) {
  return torch::TensorOptions().device(torch::kCUDA, pg.cuda_device()).dtype(dtype);
}

// Every collective of the library on CUDA tensors, checked against closed forms: rank r
// contributes (r + 1) everywhere.
void collective_values(comm::ProcessGroup& pg, comm::CommPath expected_path) {
  const int n = pg.size();
  const int r = pg.rank();
  const double total = n * (n + 1) / 2.0;
  std::vector<std::string> seen;
  std::mutex mu;
  const int id = comm::detail::add_collective_observer(
      [&](const comm::ProcessGroup&, const comm::detail::CollectiveCall& c) {
        std::lock_guard<std::mutex> lock(mu);
        seen.push_back(std::string(comm::detail::to_string(c.op)) + " " + c.label.describe() + " " +
                       (c.out.defined() ? c.out.device().str() : "-"));
      });

  run_case("all_reduce sum and max", [&] {
    auto t = torch::full({1000}, r + 1.0, on_gpu(pg));
    auto h = comm::all_reduce(pg, t, comm::ReduceOp::kSum, {comm::Phase::kStep, "sum"});
    h.wait();
    EXPECT_EQ(h.path(), expected_path);
    EXPECT_TRUE(t.is_cuda());
    EXPECT_TRUE(torch::equal(t.cpu(), torch::full({1000}, total)));
    auto m = torch::full({7}, r + 1.0, on_gpu(pg));
    comm::all_reduce(pg, m, comm::ReduceOp::kMax).wait();
    EXPECT_TRUE(torch::equal(m.cpu(), torch::full({7}, double(n))));
  });
  run_case("all_gather into a flat buffer, in place and not", [&] {
    const int64_t chunk = 4099;
    auto shard = torch::full({chunk}, r + 1.0, on_gpu(pg));
    auto flat = torch::empty({n * chunk}, on_gpu(pg));
    comm::all_gather_into(pg, flat, shard, {comm::Phase::kForward, "unit"}).wait();
    for (int k = 0; k < n; ++k)
      EXPECT_TRUE(torch::equal(flat.narrow(0, k * chunk, chunk).cpu(), torch::full({chunk}, k + 1.0))) << k;
    auto flat2 = torch::zeros({n * chunk}, on_gpu(pg));
    auto mine = flat2.narrow(0, r * chunk, chunk);
    mine.fill_(r + 1.0);
    comm::all_gather_into(pg, flat2, mine).wait();
    EXPECT_TRUE(torch::equal(flat2.cpu(), flat.cpu()));
  });
  run_case("reduce_scatter sum and average, also into its own chunk", [&] {
    const int64_t chunk = 1031;
    auto flat = torch::arange(n * chunk, on_gpu(pg)).mul_(r + 1.0);
    auto out = torch::empty({chunk}, on_gpu(pg));
    comm::reduce_scatter(pg, out, flat, comm::ReduceOp::kSum, {comm::Phase::kBackward, "unit"}).wait();
    auto expected = torch::arange(r * chunk, (r + 1) * chunk, torch::kFloat).mul_(total);
    EXPECT_TRUE(torch::allclose(out.cpu(), expected));
    auto flat2 = torch::arange(n * chunk, on_gpu(pg)).mul_(r + 1.0);
    auto inside = flat2.narrow(0, r * chunk, chunk);
    comm::reduce_scatter(pg, inside, flat2, comm::ReduceOp::kAvg).wait();
    EXPECT_TRUE(torch::allclose(inside.cpu(), expected / n));
  });
  run_case("broadcast from the last rank; bf16 all_reduce", [&] {
    auto t = torch::full({33}, r + 1.0, on_gpu(pg));
    comm::broadcast(pg, t, n - 1).wait();
    EXPECT_TRUE(torch::equal(t.cpu(), torch::full({33}, double(n))));
    auto b = torch::full({64}, r + 1.0, on_gpu(pg, at::kBFloat16));
    comm::all_reduce(pg, b).wait();
    EXPECT_TRUE(torch::equal(b.cpu().to(at::kFloat), torch::full({64}, total)));
  });
  run_case("CPU tensors on the same group still take the CPU transport", [&] {
    auto t = torch::full({5}, r + 1.0);
    auto h = comm::all_reduce(pg, t);
    h.wait();
    EXPECT_NE(h.path(), comm::CommPath::kNccl);
    EXPECT_TRUE(torch::equal(t, torch::full({5}, total)));
  });
  run_case("a tensor on another GPU than the rank's is refused", [&] {
    if (torch::cuda::device_count() < 2) return;  // one GPU: no other device to misuse
    const int other = (pg.cuda_device() + 1) % static_cast<int>(torch::cuda::device_count());
    auto t = torch::ones({3}, torch::TensorOptions().device(torch::kCUDA, other));
    EXPECT_THROW(comm::all_reduce(pg, t).wait(), c10::Error);
  });
  comm::detail::remove_collective_observer(id);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.front(), "all_reduce step sum cuda:" + std::to_string(pg.cuda_device()));
}

// The cases of ranks sharing a GPU need exactly one GPU for two ranks; on a machine with
// several, the ranks would get one each. Their workers see only the first GPU this process
// sees, so those cases run on any GPU machine: the number of GPUs is the machine's, not a
// fault, and a skip for it would fail the strict runs (CI=true, FSDP_REQUIRE_GPU=1) there.
RankOptions on_one_gpu(RankOptions o) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string all = visible != nullptr ? visible : "0";
  o.extra_env.push_back("CUDA_VISIBLE_DEVICES=" + all.substr(0, all.find(',')));
  return o;
}

}  // namespace

TEST(CudaComm, NcclAtOneRank) {
  FSDP_SKIP_WITHOUT_GPU(1);
  RankOptions o;
  o.backend = comm::Backend::kNccl;
  run_ranks(1, [](comm::ProcessGroup& pg) {
    EXPECT_EQ(pg.cuda_backend(), comm::Backend::kNccl);
    EXPECT_EQ(pg.cuda_device(), 0);
    collective_values(pg, comm::CommPath::kNccl);
  }, o);
}

TEST(CudaComm, AutoTakesNcclForOneRankPerGpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  run_ranks(1, [](comm::ProcessGroup& pg) { EXPECT_EQ(pg.cuda_backend(), comm::Backend::kNccl); });
}

TEST(CudaComm, GlooForTwoRanksOnOneGpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  RankOptions o;
  o.backend = comm::Backend::kGloo;
  run_ranks(2, [](comm::ProcessGroup& pg) {
    EXPECT_EQ(pg.cuda_backend(), comm::Backend::kGloo);
    collective_values(pg, comm::CommPath::kGloo);
    // Sub-groups inherit the placement.
    auto sub = pg.new_subgroup({0, 1});
    EXPECT_EQ(sub.cuda_backend(), comm::Backend::kGloo);
    auto t = torch::full({3}, pg.rank() + 1.0, on_gpu(pg));
    comm::all_reduce(sub, t).wait();
    EXPECT_TRUE(torch::equal(t.cpu(), torch::full({3}, 3.0)));
  }, o);
}

TEST(CudaComm, AutoTakesGlooWhenRanksShareAGpu) {
  FSDP_SKIP_WITHOUT_GPU(1);
  run_ranks(2, [](comm::ProcessGroup& pg) { EXPECT_EQ(pg.cuda_backend(), comm::Backend::kGloo); }, on_one_gpu({}));
}

TEST(CudaComm, NcclRefusesRanksSharingAGpuBeforeItStarts) {
  FSDP_SKIP_WITHOUT_GPU(1);
  RankOptions o;
  o.backend = comm::Backend::kGloo;
  o.deadline = std::chrono::seconds(120);
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto opts = worker_init_options().backend(comm::Backend::kNccl).store_prefix("nccl-shared");
    try {
      comm::init_process_group(opts);
      ADD_FAILURE() << "two ranks on one GPU were given NCCL";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      for (const char* part : {"ranks 0 and 1 share GPU-", "use Backend::kGloo", "NCCL refuses"})
        EXPECT_NE(msg.find(part), std::string::npos) << part << " missing in: " << msg;
    }
  }, on_one_gpu(o));
}
