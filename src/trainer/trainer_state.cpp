#include "trainer_state.h"

#include <mutex>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"

namespace fsdp::trainer::detail {

namespace {

constexpr const char* kMarkerKey = "trainer.marker";
constexpr const char* kStepKey = "trainer.step";
constexpr const char* kWorldKey = "trainer.world_size";
constexpr const char* kRngPrefix = "trainer.rng.rank";

std::vector<std::pair<std::string, std::string>> data_order_values(const TrainerOptions& o, int64_t train_size) {
  return {{"trainer.seed", std::to_string(o.seed())},
          {"trainer.global_batch_size", std::to_string(o.global_batch_size())},
          {"trainer.train_size", std::to_string(train_size)},
          {"trainer.shuffle", o.shuffle() ? "true" : "false"},
          {"trainer.last_batch", o.last_batch() == LastBatch::kDrop ? "drop" : "short"}};
}

/// Every rank's torch CPU generator state, one row per rank (collective).
at::Tensor gather_generator_states(const comm::ProcessGroup& pg) {
  at::Tensor state;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  // Bytes as doubles (exact) through one sum all-reduce: each rank fills its row.
  auto rows = torch::zeros({pg.size(), state.numel()}, torch::kFloat64);
  rows[pg.rank()].copy_(state.to(torch::kFloat64));
  comm::all_reduce(pg, rows, comm::ReduceOp::kSum, {comm::Phase::kTrainer, "rng states"}).wait();
  return rows.to(torch::kUInt8);
}

}  // namespace

CheckpointExtra trainer_state(const TrainerOptions& o, int64_t train_size, const comm::ProcessGroup& pg,
                              int64_t step) {
  CheckpointExtra e;
  e.values[kMarkerKey] = "1";
  e.values[kStepKey] = std::to_string(step);
  e.values[kWorldKey] = std::to_string(pg.size());
  for (auto& [key, value] : data_order_values(o, train_size)) e.values[key] = value;
  const at::Tensor rng = gather_generator_states(pg);
  for (int r = 0; r < pg.size(); ++r) e.tensors[kRngPrefix + std::to_string(r)] = rng[r].clone();
  return e;
}

std::string trainer_state_mismatch(const TrainerOptions& o, int64_t train_size, const std::string& dir,
                                   const std::map<std::string, std::string>& saved) {
  if (saved.count(kMarkerKey) == 0 || saved.count(kStepKey) == 0)
    return dir + " holds no training-loop state (no " + kStepKey +
           " in its extras): it was saved outside fsdp::Trainer's loop (by fsdp::save_checkpoint directly, or by "
           "fsdp-train before it ran on that loop), so the step, data order and generators to continue from are "
           "unknown; start afresh, or load only its weights with fsdp::load_checkpoint";
  for (const auto& [key, value] : data_order_values(o, train_size)) {
    auto it = saved.find(key);
    const std::string was = it == saved.end() ? "(not recorded)" : it->second;
    if (was != value)
      return dir + " was saved with " + key.substr(8) + " " + was + " but this run has " + value +
             "; a resumed run must see the same data in the same order: set " + key.substr(8) + " to " + was +
             " or start afresh";
  }
  return "";
}

int64_t saved_step(const CheckpointExtra& extra) { return std::stoll(extra.values.at(kStepKey)); }

void restore_generator(const CheckpointExtra& extra, const comm::ProcessGroup& pg) {
  auto w = extra.values.find(kWorldKey);
  const int saved_world = w == extra.values.end() ? 0 : std::stoi(w->second);
  const int source = saved_world == pg.size() ? pg.rank() : 0;
  auto it = extra.tensors.find(kRngPrefix + std::to_string(source));
  if (it == extra.tensors.end()) return;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(it->second.contiguous());
}

}  // namespace fsdp::trainer::detail
