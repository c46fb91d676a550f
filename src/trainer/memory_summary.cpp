#include "fsdp/trainer/memory_summary.h"

#include <algorithm>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/core/memory_estimate.h"
#include "fsdp/memory/optimizer_state_bytes.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/trainer/metrics_log.h"

namespace fsdp::trainer {

int64_t optimizer_state_bytes(torch::optim::Optimizer& opt) {
  if (auto* zero = dynamic_cast<optim::ZeroRedundancyOptimizer*>(&opt))
    return zero->get_memory_usage()[MemoryCategory::kOptimizerState];
  return memory::optimizer_state_bytes(opt);
}

MemorySample model_memory(FullyShardedBase* fsdp, torch::optim::Optimizer& opt) {
  MemorySample s;
  if (fsdp) {
    const auto ms = fsdp->memory_stats();
    s.param_bytes = ms.param_shard_bytes;
    s.grad_bytes = ms.grad_shard_bytes;
    s.unsharded_peak_bytes = ms.unsharded_peak_bytes;
  } else {
    auto* zero = dynamic_cast<optim::ZeroRedundancyOptimizer*>(&opt);
    TORCH_CHECK(zero, "fsdp::trainer::model_memory: without an FSDP model the optimizer must be a "
                      "ZeroRedundancyOptimizer (it holds the model state); pass the wrapper otherwise");
    const auto u = zero->get_memory_usage();
    s.param_bytes = u[MemoryCategory::kParameterShards] + u[MemoryCategory::kMasterWeights];
    s.grad_bytes = u[MemoryCategory::kGradients];
  }
  s.optim_bytes = optimizer_state_bytes(opt);
  s.rss_bytes = current_rss_bytes();
  return s;
}

double model_state_estimate(const Strategy& strategy, int64_t num_params, int world_size, int shard_group_size,
                            bool bf16) {
  if (strategy.is_zero())
    return estimate_zero_model_state(num_params, world_size, strategy.zero_stage(), bf16 ? 2 : 4).total();
  return estimate_model_state(num_params, world_size, strategy.resolved_fsdp().sharding_strategy(), shard_group_size)
      .total();
}

void format_bytes(double b, char* out, size_t n) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  std::snprintf(out, n, u ? "%.2f %s" : "%.0f %s", b, unit[u]);
}

void print_memory_table(std::FILE* out, const comm::ProcessGroup& pg, const MemorySample& sample,
                        const std::vector<MemoryColumn>& extra) {
  std::vector<std::string> names = {"params", "grads", "optim state", "peak unsharded", "model state"};
  std::vector<double> mine = {double(sample.param_bytes), double(sample.grad_bytes), double(sample.optim_bytes),
                              double(sample.unsharded_peak_bytes),
                              double(sample.param_bytes + sample.grad_bytes + sample.optim_bytes)};
  for (const auto& c : extra) {
    names.push_back(c.name);
    mine.push_back(c.bytes);
  }
  // Each rank fills its own row; one sum all-reduce assembles the table everywhere.
  const int n = pg.size(), cols = int(mine.size());
  auto rows = torch::zeros({n, cols}, torch::kFloat64);
  rows[pg.rank()].copy_(torch::tensor(mine, torch::kFloat64));
  comm::all_reduce(pg, rows, comm::ReduceOp::kSum, {comm::Phase::kTrainer, "memory summary"}).wait();
  if (pg.rank() != 0) return;
  // Two spaces more than the header, at least 14: room for "1023.99 MiB".
  std::vector<int> width;
  for (const auto& name : names) width.push_back(std::max<int>(14, int(name.size()) + 2));
  std::fprintf(out, "  %-6s", "rank");
  for (int c = 0; c < cols; ++c) std::fprintf(out, " %*s", width[size_t(c)], names[size_t(c)].c_str());
  std::fprintf(out, "\n");
  auto acc = rows.accessor<double, 2>();
  for (int r = 0; r < n; ++r) {
    std::fprintf(out, "  %-6d", r);
    for (int c = 0; c < cols; ++c) {
      char b[32];
      format_bytes(acc[r][c], b, sizeof b);
      std::fprintf(out, " %*s", width[size_t(c)], b);
    }
    std::fprintf(out, "\n");
  }
  std::fflush(out);
}

}  // namespace fsdp::trainer
