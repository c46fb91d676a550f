// trainer_csv: your own model and your own dataset, trained by fsdp::trainer::Trainer.
// Copy it and replace the model, the dataset and the two steps; the Trainer does the rest
// (launch, data sharding, checkpoints and exact resume, validation, metrics, memory summary).
//
//   ./trainer_csv                                              2 ranks, 60 steps
//   ./trainer_csv --steps 40 --checkpoint-dir ckpt             ... saves ckpt/step-40
//   ./trainer_csv --steps 60 --checkpoint-dir ckpt --resume auto   continues with step 41
//
// Started bare, Trainer::fit() re-executes this program under fsdp-run with --nproc ranks
// (default 2; fsdp-run found on PATH or where fsdp-cpp was built/installed); under fsdp-run,
// torchrun, srun or mpirun it joins that job instead. Everything in main() before fit() runs
// again in every rank, so it only parses flags and makes sure the data file exists.
// Rank 0 prints JSON lines on stdout (under a launcher prefixed "[rank0]: "):
//   {"step": S, "loss": L}                                after every optimizer step S (1-based)
//   {"step": S, "eval": {"accuracy": A, "loss": L}}      on the held-out rows at the end
// The Trainer's own reports (progress, memory summary) go to stderr.
//
// Compare examples/custom_loop, the same model and data with the loop written by hand.

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fsdp/core/wrappable.h"
#include "fsdp/trainer/trainer.h"

namespace fs = std::filesystem;
using namespace fsdp::trainer;

namespace {

// ---- flags (the same core flags in every example; see examples/README.md) ----------------

struct Args {
  int64_t steps = 60;
  std::string checkpoint_dir;    // empty: no checkpoints
  int64_t checkpoint_every = 0;  // 0: only after the last step
  std::string resume;            // "", "auto" or a checkpoint directory (D/step-S)
  int nproc = 2;                 // ranks started when not under a launcher
  std::string data = "trainer_csv_data.csv";
};

const char* kUsage =
    "usage: trainer_csv [--steps N] [--checkpoint-dir D] [--checkpoint-every K] [--resume auto|DIR]\n"
    "                   [--nproc N] [--data FILE]\n"
    "  --steps N             optimizer steps in all, counted from the run's start (default 60)\n"
    "  --checkpoint-dir D    save D/step-S every K steps and after the last one (the newest 2 kept)\n"
    "  --checkpoint-every K  (default 0: only after the last step)\n"
    "  --resume auto|DIR     continue from the newest D/step-S (auto; none yet: start fresh) or from DIR\n"
    "  --nproc N             ranks to start when not under a launcher (default 2)\n"
    "  --data FILE           CSV of features and labels, written on first use (default trainer_csv_data.csv)\n";

Args parse_args(int argc, char** argv) {
  Args a;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  auto number = [&](int& i) -> int64_t {
    const std::string flag = argv[i], v = value(i);
    try {
      std::size_t used = 0;
      int64_t n = std::stoll(v, &used);
      if (used == v.size() && n >= 0) return n;
    } catch (const std::exception&) {
    }
    throw std::invalid_argument(flag + " " + v + ": expected a non-negative integer");
  };
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--steps") a.steps = number(i);
    else if (f == "--checkpoint-dir") a.checkpoint_dir = value(i);
    else if (f == "--checkpoint-every") a.checkpoint_every = number(i);
    else if (f == "--resume") a.resume = value(i);
    else if (f == "--nproc") a.nproc = int(number(i));
    else if (f == "--data") a.data = value(i);
    else if (f == "-h" || f == "--help") { std::fputs(kUsage, stdout); std::exit(0); }
    else throw std::invalid_argument("unknown flag " + f + "\n" + kUsage);
  }
  if (a.nproc < 1) throw std::invalid_argument("--nproc must be at least 1");
  return a;
}

// ---- the data ---------------------------------------------------------------------------

constexpr int64_t kFeatures = 16, kClasses = 4;
// The file's first rows train, the rest are held out. 2000 is not a multiple of the global
// batch of 64: every epoch ends with a short batch of 16, which the Trainer trains on with
// its loss weighted by the samples each rank holds.
constexpr int64_t kTrainRows = 2000, kTestRows = 512;
constexpr int64_t kGlobalBatch = 64;

/// Writes the rows "f0,...,f15,label": Gaussian features labelled by a fixed random teacher
/// network (argmax of tanh(x W1 / 4) W2). Every process that finds the file missing writes
/// the same bytes to its own FILE.tmp.<pid> and renames it into place, so ranks started
/// together by a launcher need no coordination and a reader never sees half a file.
void ensure_csv(const std::string& path) {
  if (fs::exists(path)) return;
  auto gen = at::detail::createCPUGenerator(/*seed_in=*/1234);
  auto x = torch::randn({kTrainRows + kTestRows, kFeatures}, gen);
  auto w1 = torch::randn({kFeatures, 32}, gen), w2 = torch::randn({32, kClasses}, gen);
  auto y = torch::tanh(x.matmul(w1) / 4).matmul(w2).argmax(1);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) throw std::runtime_error("--data " + path + ": cannot create " + tmp + ": " + std::strerror(errno));
  for (int64_t j = 0; j < kFeatures; ++j) std::fprintf(f, "f%lld,", (long long)j);
  std::fprintf(f, "label\n");
  auto xa = x.accessor<float, 2>();
  auto ya = y.accessor<int64_t, 1>();
  for (int64_t i = 0; i < x.size(0); ++i) {
    for (int64_t j = 0; j < kFeatures; ++j) std::fprintf(f, "%.7g,", xa[i][j]);
    std::fprintf(f, "%lld\n", (long long)ya[i]);
  }
  if (std::fclose(f) != 0) throw std::runtime_error("--data " + path + ": writing " + tmp + " failed");
  fs::rename(tmp, path);
}

/// Rows [first, end) of a CSV file of kFeatures feature columns and an integer label, as a
/// torch::data dataset: example i is (features [kFeatures], label []). The Trainer stacks
/// the examples of a batch (its default collate for torch::data::Example<>).
class CsvDataset : public torch::data::datasets::Dataset<CsvDataset> {
 public:
  CsvDataset(const std::string& path, int64_t first, int64_t end) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("--data " + path + ": cannot open the file");
    std::string line;
    std::getline(in, line);  // header
    std::vector<float> features;
    std::vector<int64_t> labels;
    for (int64_t row = 0; row < end && std::getline(in, line); ++row) {
      if (row < first) continue;
      std::stringstream cells(line);
      std::string cell;
      std::vector<double> values;
      while (std::getline(cells, cell, ',')) values.push_back(std::stod(cell));
      if (int64_t(values.size()) != kFeatures + 1)
        throw std::runtime_error("--data " + path + ": line " + std::to_string(row + 2) + " has " +
                                 std::to_string(values.size()) + " columns, expected " +
                                 std::to_string(kFeatures + 1) + "; delete the file to have it written again");
      features.insert(features.end(), values.begin(), values.end() - 1);
      labels.push_back(int64_t(values.back()));
    }
    const int64_t rows = int64_t(labels.size());
    if (rows != end - first)
      throw std::runtime_error("--data " + path + ": has " + std::to_string(first + rows) + " data rows, expected " +
                               std::to_string(end) + "; delete the file to have it written again");
    features_ = torch::tensor(features).view({rows, kFeatures});
    labels_ = torch::tensor(labels);
  }

  torch::data::Example<> get(size_t index) override { return {features_[int64_t(index)], labels_[int64_t(index)]}; }
  torch::optional<size_t> size() const override { return size_t(labels_.size(0)); }

 private:
  torch::Tensor features_, labels_;
};

// ---- the model ----------------------------------------------------------------------------

/// A residual MLP block: an ordinary module, unchanged for FSDP.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc1 = register_module("fc1", torch::nn::Linear(dim, 2 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(2 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2->forward(torch::gelu(fc1->forward(norm->forward(x)))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

/// Each block is declared as fsdp::Wrappable<BlockImpl> so that FSDP can make it a unit;
/// built inside the Trainer's ShardedInitContext, each block is sharded as soon as it exists.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t in, int64_t dim, int64_t classes, int blocks_count) {
    embed = register_module("embed", torch::nn::Linear(in, dim));
    for (int i = 0; i < blocks_count; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), fsdp::Wrappable<BlockImpl>(dim)));
    head = register_module("head", torch::nn::Linear(dim, classes));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = embed->forward(x);
    for (auto& b : blocks) x = b->forward(x);
    return head->forward(x);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<fsdp::Wrappable<BlockImpl>> blocks;
};
TORCH_MODULE(Net);

// ---- output: the examples' JSON lines ---------------------------------------------------

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);  // the Trainer's losses are doubles: round-trips
  return buf;
}

/// Rank 0 prints a line per step and one for the final validation (examples/README.md).
struct JsonLines : Callback {
  std::string name;
  bool lead = false;
  explicit JsonLines(std::string n) : name(std::move(n)) {}
  void on_train_start(const TrainStart& s) override {
    lead = s.rank == 0;
    if (lead)
      std::fprintf(stderr, "%s: %d ranks, full_shard, global batch %lld, steps %lld to %lld\n", name.c_str(),
                   s.world_size, (long long)kGlobalBatch, (long long)s.first_step, (long long)s.total_steps);
  }
  void on_step_end(const StepMetrics& m) override {
    if (lead) print("{\"step\": " + std::to_string(m.step) + ", \"loss\": " + fmt(m.loss) + "}");
  }
  void on_validation_end(const ValidationMetrics& m) override {
    if (!lead) return;
    std::string line = "{\"step\": " + std::to_string(m.step) + ", \"eval\": {";
    const char* sep = "";
    for (auto& [key, v] : m.values) {
      line += std::string(sep) + "\"" + key + "\": " + fmt(v);
      sep = ", ";
    }
    print(line + "}}");
  }
  static void print(const std::string& s) {
    std::fputs((s + "\n").c_str(), stdout);
    std::fflush(stdout);
  }
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse_args(argc, argv);
    ensure_csv(a.data);

    Trainer<NetImpl> trainer(TrainerOptions()
                                 .strategy(Strategy(StrategyKind::kFullShard)
                                               .fsdp(fsdp::Options().auto_wrap_policy(
                                                   fsdp::module_type_policy<BlockImpl>())))
                                 .max_steps(a.steps)
                                 .global_batch_size(kGlobalBatch)
                                 .seed(0)
                                 .checkpoint_dir(a.checkpoint_dir)
                                 .checkpoint_interval(a.checkpoint_every)
                                 .resume(a.resume)
                                 .devices(under_launcher() ? 0 : a.nproc)  // 0: as many as the launcher started
                                 .threads(1)
                                 .progress(false));
    trainer.model([] { return Net(kFeatures, 64, kClasses, 3); })
        .optimizer([](std::vector<torch::Tensor> params) {
          return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(3e-3));
        })
        .train_data(CsvDataset(a.data, 0, kTrainRows))
        .val_data(CsvDataset(a.data, kTrainRows, kTrainRows + kTestRows))
        .training_step([](Trainer<NetImpl>::Model& model, torch::data::Example<>& batch) {
          // The mean over this rank's samples; the Trainer weighs and reduces it.
          return torch::nn::functional::cross_entropy(model.forward(batch.data), batch.target);
        })
        .validation_step([](Trainer<NetImpl>::Model& model, torch::data::Example<>& batch) {
          auto logits = model.forward(batch.data);
          return std::map<std::string, double>{
              {"loss", torch::nn::functional::cross_entropy(logits, batch.target).item<double>()},
              {"accuracy", logits.argmax(1).eq(batch.target).to(torch::kDouble).mean().item<double>()}};
        })
        .callback(std::make_shared<JsonLines>("trainer_csv"));
    trainer.fit();
    return 0;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "trainer_csv: error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer_csv: error: %s\n", e.what());
  }
  return 1;
}
