#pragma once
// The names the documentation's C++ fragments use without declaring them: what a reader's
// program holds at the point where a fragment picks up (a process group, a wrapped model, its
// optimizer, a batch). Declared, never defined: fragments are compiled, not linked or run
// (scripts/extract_snippets.py, rule 2). A fragment that declares one of these names itself
// hides the fixture, since it is compiled inside its own namespace.
//
// Keep the list to names a reader recognises without being told: a new fragment that needs
// more context than this should show it, or be a whole program.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/options.h"
#include "fsdp/core/call.h"
#include "fsdp/core/lora_linear.h"
#include "fsdp/core/wrappable.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/checkpoint.h"

namespace snippet_fixtures {

// --- models -----------------------------------------------------------------------
/// A block that may become a unit (README, "Units in custom models").
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d);
  torch::Tensor forward(torch::Tensor x);
};
/// Blocks held as fsdp::Wrappable and a head: Net(d, layers).
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int layers);
  torch::Tensor forward(torch::Tensor x);
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

/// The configuration a model is built from: MyNet(cfg), GptImpl(cfg).
struct Config {
  int64_t dim = 64;
  int layers = 2;
};
/// Any model of the reader's: MyNet() or MyNet(cfg).
struct MyNetImpl : torch::nn::Module {
  MyNetImpl();
  explicit MyNetImpl(const Config& cfg);
  torch::Tensor forward(torch::Tensor x);
};
TORCH_MODULE(MyNet);
/// A transformer built inside a ShardedInitContext (its blocks fsdp::Wrappable).
struct GptImpl : torch::nn::Module {
  explicit GptImpl(const Config& cfg);
  torch::Tensor forward(torch::Tensor x);
};

// --- data -------------------------------------------------------------------------
/// A map-style torch::data dataset read from a file: MyDataset("train.csv").
struct MyDataset : torch::data::datasets::Dataset<MyDataset> {
  explicit MyDataset(const std::string& path);
  torch::data::Example<> get(size_t index) override;
  torch::optional<size_t> size() const override;
};
using MyCsvDataset = MyDataset;

// --- a rank's state in the middle of its program ----------------------------------
extern fsdp::comm::ProcessGroup pg;
extern int rank;
extern Config cfg;
extern fsdp::Options options;
/// An FSDP-wrapped model (the README's Net) and its optimizer.
extern fsdp::FullyShardedDataParallel<NetImpl> model, fsdp_model;
extern torch::optim::AdamW optimizer;
extern torch::optim::Adam adam;
/// ZeRO optimizers (a ZeroRedundancyOptimizer is also a torch::optim::Optimizer).
extern fsdp::optim::ZeroRedundancyOptimizer opt, opt2, zero_opt;
extern std::vector<torch::optim::OptimizerParamGroup> groups;
/// A batch (x, y), this rank's part of it (x_local, y_local), and a loss.
extern torch::Tensor x, y, x_local, y_local, loss;
torch::Tensor loss_fn(const torch::Tensor& output);
/// A model's list of BlockImpl entries (fsdp::call's).
extern torch::nn::ModuleList blocks;
/// The optimizer steps done, and what a checkpoint carries besides the model.
extern int64_t step;
extern fsdp::CheckpointExtra extra;

}  // namespace snippet_fixtures
