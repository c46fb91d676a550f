// custom_loop: FSDP training with your own model, your own dataset and your own loop,
// using fsdp-cpp directly (no Trainer). Copy it and replace the model and the data.
//
//   ./custom_loop                                              2 ranks, 60 steps
//   ./custom_loop --steps 40 --checkpoint-dir ckpt             ... saves ckpt/latest at step 40
//   ./custom_loop --steps 60 --checkpoint-dir ckpt --resume auto   continues with step 41
//
// Started bare, it re-executes itself under fsdp-run (from PATH) with --nproc ranks (default 2);
// under fsdp-run, torchrun, srun or mpirun it joins that job instead.
// Rank 0 prints JSON lines on stdout (under a launcher prefixed "[rank0]: "):
//   {"step": S, "loss": L}                                after every optimizer step S (1-based)
//   {"step": S, "eval": {"loss": L, "accuracy": A}}      on the held-out rows at the end
//
// What it shows, top to bottom:
//   1. launching: re-execute under fsdp-run when no launcher is around;
//   2. a torch::data dataset read from a CSV file (which rank 0 generates on first use);
//   3. a model whose blocks are fsdp::Wrappable members, wrapped by FullyShardedDataParallel
//      with a module-type auto-wrap policy (one unit per block, the rest in the root unit);
//   4. the loop: torch's DistributedRandomSampler splits every epoch between the ranks, the
//      loss is the mean over the global batch;
//   5. checkpoints through fsdp::save_checkpoint / load_checkpoint (include/fsdp/state/
//      checkpoint.h), holding everything an exact resume needs: parameters, Adam state,
//      the step (which fixes the data position) and the torch CPU RNG.
// A resumed run prints the same losses, bit for bit, as a run that was never stopped, at the
// same number of ranks (DistributedRandomSampler's split depends on the world size).

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/wrappable.h"
#include "fsdp/state/checkpoint.h"

namespace fs = std::filesystem;

namespace {

// ---- 0. flags (the same core flags in every example; see examples/README.md) -------------

struct Args {
  int64_t steps = 60;
  std::string checkpoint_dir;    // empty: no checkpoints
  int64_t checkpoint_every = 0;  // 0: only after the last step
  std::string resume;            // "", "auto" (DIR/latest if it exists) or a checkpoint directory
  int nproc = 2;                 // ranks started when not under a launcher
  std::string data = "custom_loop_data.csv";
};

const char* kUsage =
    "usage: custom_loop [--steps N] [--checkpoint-dir D] [--checkpoint-every K] [--resume auto|DIR]\n"
    "                   [--nproc N] [--data FILE]\n"
    "  --steps N             optimizer steps in all, counted from the run's start (default 60)\n"
    "  --checkpoint-dir D    save D/latest every K steps and after the last one\n"
    "  --checkpoint-every K  (default 0: only after the last step)\n"
    "  --resume auto|DIR     continue from D/latest (auto; none yet: start fresh) or from DIR\n"
    "  --nproc N             ranks to start when not under a launcher (default 2)\n"
    "  --data FILE           CSV of features and labels, written on first use (default custom_loop_data.csv)\n";

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
  if (a.resume == "auto" && a.checkpoint_dir.empty())
    throw std::invalid_argument("--resume auto looks in --checkpoint-dir D: pass both");
  if (a.nproc < 1) throw std::invalid_argument("--nproc must be at least 1");
  return a;
}

// ---- 1. launching -----------------------------------------------------------------------

/// True when a launcher that fsdp::comm::init_process_group understands placed this process.
bool under_launcher() {
  return std::getenv("RANK") || std::getenv("WORLD_SIZE") || std::getenv("SLURM_PROCID") ||
         std::getenv("OMPI_COMM_WORLD_RANK");
}

/// Replaces this process with `fsdp-run --nproc N -- <this program> <same args>`, fsdp-run
/// found on PATH (`cmake --install` puts it in <prefix>/bin): everything in main before this
/// call runs again in every rank. Returns only on failure.
std::string relaunch_under_fsdp_run(int nproc, int argc, char** argv) {
  // /proc/self/exe, not argv[0]: argv[0] may be a bare name found through PATH.
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return std::string("cannot read /proc/self/exe: ") + std::strerror(errno);
  self[n] = '\0';
  std::vector<std::string> args = {"fsdp-run", "--nproc", std::to_string(nproc), "--", self};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> cargs;
  for (auto& s : args) cargs.push_back(s.data());
  cargs.push_back(nullptr);
  execvp("fsdp-run", cargs.data());
  return std::string("not started by a launcher, and starting fsdp-run failed (") + std::strerror(errno) +
         "): put fsdp-cpp's <prefix>/bin on PATH, or start " + argv[0] +
         " under fsdp-run, torchrun, srun or mpirun yourself";
}

// ---- 2. the data --------------------------------------------------------------------------

constexpr int64_t kFeatures = 16, kClasses = 4;
constexpr int64_t kTrainRows = 2048, kTestRows = 512;  // the file's first rows train, the rest test
constexpr int64_t kGlobalBatch = 64;                   // samples per optimizer step, all ranks together

/// Writes kTrainRows + kTestRows rows "f0,...,f15,label": Gaussian features labelled by a
/// fixed random teacher network (argmax of tanh(x W1 / 4) W2), which a small model learns.
/// Written to FILE.tmp and renamed: a reader never sees half a file.
void write_csv(const std::string& path) {
  auto gen = at::detail::createCPUGenerator(/*seed_in=*/1234);
  auto x = torch::randn({kTrainRows + kTestRows, kFeatures}, gen);
  auto w1 = torch::randn({kFeatures, 32}, gen), w2 = torch::randn({32, kClasses}, gen);
  auto y = torch::tanh(x.matmul(w1) / 4).matmul(w2).argmax(1);
  const std::string tmp = path + ".tmp";
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

/// Rows [first, end) of a CSV file of kFeatures feature columns and an integer label,
/// as a torch::data dataset: example i is (features [kFeatures], label []).
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

  const torch::Tensor& features() const { return features_; }
  const torch::Tensor& labels() const { return labels_; }

 private:
  torch::Tensor features_, labels_;
};

// ---- 3. the model ---------------------------------------------------------------------------

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

/// The model: each block is declared as fsdp::Wrappable<BlockImpl> (instead of a Block
/// holder) so that FSDP can make it a unit; the wrap policy below decides that it does.
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

// ---- 5. checkpoints -----------------------------------------------------------------------

constexpr const char* kStepKey = "step";
constexpr const char* kRngKey = "torch_cpu_rng";

fsdp::CheckpointExtra training_state(int64_t step) {
  fsdp::CheckpointExtra e;
  e.values[kStepKey] = std::to_string(step);
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  e.tensors[kRngKey] = gen.get_state();
  return e;
}

/// Restores the RNG and returns the step the checkpoint was saved after.
int64_t restore_training_state(const fsdp::CheckpointExtra& e, const std::string& dir) {
  auto step = e.values.find(kStepKey);
  auto rng = e.tensors.find(kRngKey);
  if (step == e.values.end() || rng == e.tensors.end())
    throw std::runtime_error("--resume " + dir + ": this checkpoint was not written by custom_loop (no step/RNG)");
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(rng->second);
  return std::stoll(step->second);
}

/// The checkpoint to resume from, the same on every rank: rank 0 looks, then tells the others
/// (on several machines their views of the directory may differ for a moment).
std::string checkpoint_to_resume(const Args& a, const fsdp::comm::ProcessGroup& pg) {
  if (a.resume != "auto") return a.resume;
  const fs::path latest = fs::path(a.checkpoint_dir) / "latest";
  auto found = torch::zeros({1}, torch::kInt32);
  if (pg.rank() == 0) {
    // save_checkpoint replaces `latest` by two renames; load_checkpoint falls back to
    // `latest.old` when a crash fell between them.
    const bool exists = fs::exists(latest / "metadata.json") || fs::exists(fs::path(latest.string() + ".old") / "metadata.json");
    found.fill_(exists ? 1 : 0);
  }
  fsdp::comm::broadcast(pg, found, 0).wait();
  return found.item<int>() ? latest.string() : "";
}

void print_json_line(const std::string& s) {
  std::fputs((s + "\n").c_str(), stdout);
  std::fflush(stdout);
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);  // round-trips a float exactly
  return buf;
}

int run(const Args& a) {
  auto pg = fsdp::comm::init_process_group();  // from fsdp-run's / torchrun's / srun's environment
  const int rank = pg.rank(), world = pg.size();
  if (kGlobalBatch % world != 0)
    throw std::invalid_argument("the global batch of " + std::to_string(kGlobalBatch) +
                                " samples does not split evenly over " + std::to_string(world) +
                                " ranks; run on a number of ranks that divides it (1, 2, 4, 8, ...)");

  // Data: rank 0 writes the file on first use; the others wait for it at the barrier.
  if (rank == 0 && !fs::exists(a.data)) write_csv(a.data);
  fsdp::comm::barrier(pg);
  CsvDataset train(a.data, 0, kTrainRows), test(a.data, kTrainRows, kTrainRows + kTestRows);

  // Model: the same seed on every rank gives every rank the same initial weights.
  torch::manual_seed(0);
  Net net(kFeatures, 64, kClasses, 3);
  int64_t num_params = 0;
  for (const auto& p : net->parameters()) num_params += p.numel();
  auto model = fsdp::FullyShardedDataParallel(
      net, pg,
      fsdp::Options()
          .sharding_strategy(fsdp::ShardingStrategy::kFullShard)
          .auto_wrap_policy(fsdp::module_type_policy<BlockImpl>()));
  // The optimizer is built over the sharded parameters: each rank keeps Adam's state for its
  // shard only.
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));

  if (rank == 0)
    std::fprintf(stderr, "custom_loop: %d ranks, FULL_SHARD, %lld parameters in %zu units, global batch %lld, %lld steps\n",
                 world, (long long)num_params, model->unit_paths().size(), (long long)kGlobalBatch, (long long)a.steps);

  int64_t first_step = 0;
  if (!a.resume.empty()) {
    const std::string dir = checkpoint_to_resume(a, pg);
    if (!dir.empty()) {
      first_step = restore_training_state(fsdp::load_checkpoint(dir, *model, &optimizer), dir);
      if (first_step > a.steps)
        throw std::invalid_argument("--resume " + dir + ": the checkpoint is after step " + std::to_string(first_step) +
                                    " but --steps is " + std::to_string(a.steps) + "; ask for more steps");
      if (rank == 0) std::fprintf(stderr, "custom_loop: resumed from %s after step %lld\n", dir.c_str(), (long long)first_step);
    } else if (rank == 0) {
      std::fprintf(stderr, "custom_loop: --resume auto: no checkpoint in %s yet; starting fresh\n", a.checkpoint_dir.c_str());
    }
  }
  auto save = [&](int64_t step) {
    if (a.checkpoint_dir.empty()) return;
    // Collective; replaces DIR/latest atomically (written as latest.tmp, then renamed).
    fsdp::save_checkpoint((fs::path(a.checkpoint_dir) / "latest").string(), *model, &optimizer, training_state(step));
  };

  // The loop. An epoch is one pass of DistributedRandomSampler: its permutation depends only
  // on the epoch, each rank takes a 1/world share of it, and drop_last keeps every step's
  // global batch at kGlobalBatch. Step s (0-based) is batch s % steps_per_epoch of epoch
  // s / steps_per_epoch, so a resumed run finds its place from the step alone.
  const int64_t local_batch = kGlobalBatch / world;
  const int64_t steps_per_epoch = (kTrainRows / world) / local_batch;
  int64_t step = first_step;
  while (step < a.steps) {
    torch::data::samplers::DistributedRandomSampler sampler(kTrainRows, world, rank, /*allow_duplicates=*/false);
    sampler.set_epoch(size_t(step / steps_per_epoch));
    auto loader = torch::data::make_data_loader(train.map(torch::data::transforms::Stack<>()), std::move(sampler),
                                                torch::data::DataLoaderOptions(local_batch).drop_last(true));
    int64_t skip = step % steps_per_epoch;
    for (auto& batch : *loader) {
      if (skip > 0) { --skip; continue; }
      if (step == a.steps) break;
      optimizer.zero_grad(/*set_to_none=*/false);
      auto loss = torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
      loss.backward();
      optimizer.step();
      ++step;
      // The step's loss over the global batch: the mean of the ranks' means (equal shares).
      auto global = loss.detach().reshape({1}).clone();
      fsdp::comm::all_reduce(pg, global).wait();
      if (rank == 0)
        print_json_line("{\"step\": " + std::to_string(step) + ", \"loss\": " + fmt(global.item<float>() / world) + "}");
      if (step == a.steps || (a.checkpoint_every > 0 && step % a.checkpoint_every == 0)) save(step);
    }
  }

  // Held-out rows: each rank evaluates a contiguous share; sums are reduced over the ranks.
  {
    torch::NoGradGuard no_grad;
    const int64_t lo = kTestRows * rank / world, hi = kTestRows * (rank + 1) / world;
    auto x = test.features().slice(0, lo, hi), y = test.labels().slice(0, lo, hi);
    auto logits = model->forward(x);
    namespace F = torch::nn::functional;
    auto sums = torch::stack({F::cross_entropy(logits, y, F::CrossEntropyFuncOptions().reduction(torch::kSum)),
                              logits.argmax(1).eq(y).sum().to(torch::kFloat)});
    fsdp::comm::all_reduce(pg, sums).wait();
    if (rank == 0)
      print_json_line("{\"step\": " + std::to_string(step) + ", \"eval\": {\"loss\": " +
                      fmt(sums[0].item<float>() / kTestRows) + ", \"accuracy\": " +
                      fmt(sums[1].item<float>() / kTestRows) + "}}");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse_args(argc, argv);
    if (!under_launcher()) {
      const std::string why = relaunch_under_fsdp_run(args.nproc, argc, argv);
      std::fprintf(stderr, "custom_loop: error: %s\n", why.c_str());
      return 1;
    }
    return run(args);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "custom_loop: error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_loop: error: %s\n", e.what());
  }
  return 1;
}
