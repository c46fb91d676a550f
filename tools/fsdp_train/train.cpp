#include "train.h"

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "estimate.h"
#include "phase_memory.h"
#include "fsdp/autograd/checkpoint_wrapper.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/memory_estimate.h"
#include "fsdp/core/sharded_init.h"
#include "fsdp/core/memory_tracer.h"
#include "fsdp/optim/cpu_adam.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/trainer/memory_summary.h"
#include "fsdp/trainer/training_loop.h"
#include "models.h"
#include "resume.h"
#include "task.h"
#include "text.h"

namespace fsdp::train {

namespace {

namespace comm = fsdp::comm;

using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

/// Mean cross-entropy of logits [..., K] against class indices [...] (see task.h).
torch::Tensor task_loss(const torch::Tensor& logits, const torch::Tensor& targets,
                        torch::nn::functional::CrossEntropyFuncOptions opts = {}) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), opts);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o,
                                                        std::vector<torch::Tensor> params) {
  const double lr = o.effective_lr();
  if (o.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(lr).momentum(o.momentum).weight_decay(o.weight_decay));
  if (o.optimizer == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr).weight_decay(o.weight_decay));
  if (o.optimizer == "adamw")
    return std::make_unique<torch::optim::AdamW>(params,
                                                 torch::optim::AdamWOptions(lr).weight_decay(o.weight_decay));
  TORCH_CHECK(o.optimizer == "cpu_adam", "unknown optimizer '", o.optimizer, "' (parser should have caught it)");
  return std::make_unique<fsdp::optim::CPUAdam>(params, fsdp::optim::CPUAdamOptions(lr).weight_decay(o.weight_decay));
}

/// zero1 / zero2: the same optimizer as make_optimizer, sharded by ZeroRedundancyOptimizer
/// over the unwrapped model (which it broadcasts from rank 0).
std::unique_ptr<torch::optim::Optimizer> make_zero_optimizer(const TrainOptions& o, const comm::ProcessGroup& pg,
                                                             std::shared_ptr<torch::nn::Module> net) {
  namespace zo = fsdp::optim;
  const double lr = o.effective_lr();
  zo::InnerOptimizerFactory inner;
  if (o.optimizer == "sgd")
    inner = zo::inner_optimizer<torch::optim::SGD>(
        torch::optim::SGDOptions(lr).momentum(o.momentum).weight_decay(o.weight_decay));
  else if (o.optimizer == "adam")
    inner = zo::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(lr).weight_decay(o.weight_decay));
  else if (o.optimizer == "adamw")
    inner = zo::inner_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(lr).weight_decay(o.weight_decay));
  else
    inner = zo::inner_optimizer<zo::CPUAdam>(zo::CPUAdamOptions(lr).weight_decay(o.weight_decay));
  auto params = net->parameters();
  const int stage = fsdp::trainer::Strategy::parse(o.strategy).zero_stage();
  auto options = zo::ZeroOptions()
                     .process_group(pg)
                     .stage(stage)
                     .module(net)
                     .optimizer_in_backward(o.optimizer_in_backward)
                     .cpu_offload(o.cpu_offload)
                     .gpu_margin_mem_ratio(o.gpu_margin_mem_ratio);
  // bf16 as under FSDP: bf16 parameters for compute, fp32 masters stepped, fp32 reduced gradients.
  if (o.mixed_precision == "bf16") options.param_dtype(torch::kBFloat16);
  return std::make_unique<zo::ZeroRedundancyOptimizer>(params, inner, options);
}

/// The model on the rank's device (--device), before it is wrapped or handed to ZeRO.
void place(torch::nn::Module& model, const torch::Device& device) {
  if (!device.is_cpu()) model.to(device);
}

/// The batch on the rank's device (--device); as is on the CPU.
Batch to_device(Batch b, const torch::Device& device) {
  if (device.is_cpu()) return b;
  return {b.inputs.to(device), b.targets.to(device)};
}

struct EvalResult {
  double loss = 0, accuracy = 0;
  int64_t correct = 0, total = 0;  ///< predictions: images, or bytes of the windows
};

/// Each rank evaluates its contiguous slice of the task's evaluation set; sums are
/// all-reduced. Every rank runs the same number of forwards (FSDP's forward is collective),
/// the last ones possibly on empty batches when the slices differ in size.
EvalResult evaluate(const Forward& forward, const comm::ProcessGroup& pg, const Task& task,
                    const torch::Device& device) {
  torch::NoGradGuard no_grad;
  const int64_t n = task.eval_size(), r = pg.rank(), w = pg.size(), per_batch = task.eval_batch_size();
  const int64_t begin = r * n / w, end = (r + 1) * n / w;
  const int64_t max_slice = (n + w - 1) / w;
  const int64_t batches = (max_slice + per_batch - 1) / per_batch;
  double loss_sum = 0, correct = 0, count = 0;
  for (int64_t b = 0; b < batches; ++b) {
    int64_t lo = std::min(end, begin + b * per_batch), hi = std::min(end, lo + per_batch);
    Batch batch = to_device(task.eval_batch(lo, hi), device);
    torch::Tensor logits = forward(batch.inputs);
    if (hi > lo) {
      loss_sum += task_loss(logits, batch.targets,
                            torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                      .item<double>();
      correct += logits.argmax(-1).eq(batch.targets).sum().item<double>();
      count += double(batch.targets.numel());
    }
  }
  auto sums = torch::tensor({loss_sum, correct, count}, torch::kFloat64);
  comm::all_reduce(pg, sums, comm::ReduceOp::kSum).wait();
  EvalResult e;
  e.total = int64_t(sums[2].item<double>() + 0.5);
  e.correct = int64_t(sums[1].item<double>() + 0.5);
  e.loss = sums[0].item<double>() / double(std::max<int64_t>(e.total, 1));
  e.accuracy = double(e.correct) / double(std::max<int64_t>(e.total, 1));
  return e;
}

/// The summary on stdout (rank 0 prints; collective for the memory table): the run, the
/// final evaluation, training throughput, then each rank's model state next to the ZeRO
/// accounting for the strategy, and its build and train resident peaks.
void print_summary(const TrainOptions& o, const comm::ProcessGroup& pg, const Task& task, const EvalResult& e,
                   int64_t steps, double train_seconds, int64_t num_params, const fsdp::trainer::MemorySample& memory,
                   const PhaseMemory& phases) {
  const int n = pg.size();
  const bool lead = pg.rank() == 0;
  // Read before anything is printed: the peaks are of the run, not of the summary.
  const std::vector<fsdp::trainer::MemoryColumn> columns = {{"unsharded Adam", 16.0 * double(num_params)},
                                                            {"build peak", double(phases.construction_peak())},
                                                            {"train peak", double(phases.training_peak())}};
  if (lead) {
    std::printf("== fsdp-train summary: %s, %s, %d ranks x %d threads, %s (lr %g), global batch %lld ==\n",
                o.model.c_str(), o.strategy.c_str(), n, o.threads, o.optimizer.c_str(), o.effective_lr(),
                (long long)o.batch_size);
    std::printf("%s accuracy: %.2f%% (%lld/%lld), %s loss %.4f\n", task.eval_name(), 100.0 * e.accuracy,
                (long long)e.correct, (long long)e.total, task.eval_name(), e.loss);
    if (steps > 0)
      std::printf("throughput: %.0f %s/s (%lld steps, %lld %s in %.1f s)\n",
                  double(steps * o.batch_size) / train_seconds, task.sample_name(), (long long)steps,
                  (long long)(steps * o.batch_size), task.sample_name(), train_seconds);
    if (!o.export_safetensors.empty())
      std::printf("weights: %s (safetensors)\n", o.export_safetensors.c_str());
    // The ZeRO accounting for this run's strategy (bf16 parameters under zero1/zero2 with
    // --mixed-precision bf16), next to what each rank measured.
    // HYBRID_SHARD's default shard group is the ranks of one host, as the wrapper resolves it.
    const int group = o.shard_group_size > 0 ? o.shard_group_size : pg.local_world_size();
    const double zero = fsdp::trainer::model_state_estimate(fsdp::trainer::Strategy::parse(o.strategy), num_params,
                                                            n, group, o.mixed_precision == "bf16");
    char z[32];
    format_bytes(zero, z, sizeof z);
    std::printf("memory per rank (%lld parameters; unsharded Adam training holds 16 B/param = %lld B; "
                "ZeRO estimate for %s: %s):\n",
                (long long)num_params, (long long)(16 * num_params), o.strategy.c_str(), z);
    std::fflush(stdout);
  }
  fsdp::trainer::print_memory_table(stdout, pg, memory, columns);
  // Resident memory, so it includes allocator slack, unlike the model-state columns;
  // --estimate-memory predicts the build peak.
  if (lead) {
    std::printf("  (build peak / train peak: highest resident memory above the rank's resident set before the model "
                "was built, while building and wrapping it / while training%s)\n",
                phases.exact() ? "" : "; the kernel's peak could not be reset, so these are the process's peaks so far");
    std::fflush(stdout);
  }
}

/// Parameters of the unwrapped model, checked against the arithmetic --estimate-memory uses.
int64_t count_params(const TrainOptions& o, const torch::nn::Module& net) {
  int64_t n = 0;
  for (const auto& p : net.parameters()) n += p.numel();
  TORCH_INTERNAL_ASSERT(n == model_num_params(o), "fsdp-train: --model ", o.model, " has ", n,
                        " parameters but estimate.cpp computes ", model_num_params(o), "; fix model_num_params");
  return n;
}

/// --activation-checkpointing: every block's forward runs inside fsdp::checkpoint (under FSDP
/// the block's unit inside it), set before wrapping.
void checkpoint_blocks(const TrainOptions& o, torch::nn::Module& gpt) {
  if (!o.activation_checkpointing) return;
  const int n = fsdp::apply_activation_checkpointing(gpt, fsdp::checkpoint_module_type<GptBlockImpl>());
  TORCH_INTERNAL_ASSERT(n == o.layers, "fsdp-train: ", n, " of ", o.layers, " gpt blocks are checkpoint candidates");
}

/// fsdp-train's side of the library's loop: the header's "resumed from" line, the
/// memory tracer's optimizer steps, and its own extras in every checkpoint.
class TrainHooks : public fsdp::trainer::Callback {
 public:
  TrainHooks(const TrainOptions& o, bool lead, fsdp::MemoryTracer* tracer) : o_(o), lead_(lead), tracer_(tracer) {}
  void on_train_start(const fsdp::trainer::TrainStart& start) override {
    if (lead_ && !start.resumed_from.empty())
      std::fprintf(stderr, "fsdp-train: resumed from %s at step %lld\n", start.resumed_from.c_str(),
                   (long long)start.first_step);
  }
  void on_optimizer_step(int64_t) override {
    if (tracer_) tracer_->step();
  }
  void on_save_checkpoint(fsdp::CheckpointExtra& extra) override { add_training_state(o_, extra); }
  // Only --metrics (rank 0, written by the loop) reads the per-step memory.
  bool needs_memory() const override { return false; }

 private:
  const TrainOptions& o_;
  bool lead_;
  fsdp::MemoryTracer* tracer_;
};

/// fsdp-train's flags as the library loop's options: the Task's batches, fsdp-train's
/// evaluation and its metrics format (truncated on resume, validation under "eval");
/// step-0 saved with --checkpoint-dir; each step's loss reduced while the next step runs
/// (its callbacks only record); the summary is fsdp-train's own.
fsdp::trainer::TrainerOptions loop_options(const TrainOptions& o, int64_t total_steps) {
  return fsdp::trainer::TrainerOptions()
      .strategy(fsdp::trainer::Strategy::parse(o.strategy))
      .max_steps(total_steps)
      .max_epochs(0)  // total_steps counts them (0: --steps 0, a conversion)
      .init_from(o.init_from)
      .export_safetensors(o.export_safetensors)
      .export_options(fsdp::SafetensorsSaveOptions().max_shard_bytes(o.export_max_shard_bytes))
      .global_batch_size(o.batch_size)
      .shuffle(o.shuffle)
      .seed(o.seed)
      .val_check_interval(o.eval_every)
      .checkpoint_dir(o.checkpoint_dir)
      .checkpoint_interval(o.checkpoint_every)
      .keep_checkpoints(o.keep_checkpoints)
      .checkpoint_at_start(true)
      .async_checkpoint(o.async_checkpoint)
      .resume(o.resume)
      .metrics_file(o.metrics_path)
      .metrics_append_on_resume(false)
      .metrics_validation_key("eval")
      .progress(true)
      .log_every_n_steps(o.log_every)
      .overlap_step_metrics(true)
      .memory_summary(false);
}

/// The Task's data and fsdp-train's steps as the loop's hooks: the Task's batch
/// sampler, the task loss, fsdp-train's evaluation (its result kept in `last_eval` for
/// the summary) and its resume check (the flags that must match, resume.h).
fsdp::trainer::LoopData loop_data(const TrainOptions& o, const comm::ProcessGroup& pg, Task& task,
                                  const Forward& forward, const torch::Device& device, EvalResult& last_eval) {
  fsdp::trainer::LoopData data;
  data.train_size = task.train_size();
  data.steps_per_epoch = task.steps_per_epoch();
  data.batch_indices = [&task](int64_t step) { return task.train_indices(step); };
  data.train_step = [&task, &forward, device](const std::vector<int64_t>& indices) {
    Batch batch = to_device(task.train_samples(indices), device);
    return task_loss(forward(batch.inputs), batch.targets);
  };
  data.validation_loop = [&pg, &task, &forward, device, &last_eval](int64_t step) {
    last_eval = evaluate(forward, pg, task, device);
    fsdp::trainer::ValidationMetrics vm;
    vm.values = {{"loss", last_eval.loss}, {"accuracy", last_eval.accuracy}};
    vm.samples = last_eval.total;
    char line[200];
    std::snprintf(line, sizeof line, "eval @ step %lld: %s loss %.4f  accuracy %.2f%%", (long long)step,
                  task.eval_name(), last_eval.loss, 100.0 * last_eval.accuracy);
    vm.note = line;
    return vm;
  };
  data.resume_check = [&o](const std::string& dir, const std::map<std::string, std::string>& saved) {
    TrainOptions candidate = o;
    candidate.resume = dir;
    return check_compatible(candidate, saved);
  };
  return data;
}

/// Trains with the library's loop (fsdp::trainer::run_training_loop), then
/// reports. `fsdp_model` is the FSDP wrapper (parameters, units, memory, checkpoints), or
/// null under zero1/zero2 (`opt` is then the ZeroRedundancyOptimizer); `module` the
/// unwrapped model; `forward` the typed forward.
int train(const TrainOptions& o, const comm::ProcessGroup& pg, FullyShardedBase* fsdp_model, torch::nn::Module& module,
          std::unique_ptr<torch::optim::Optimizer> opt, const Forward& forward, Task& task, int64_t num_params,
          const PhaseMemory& phases, const torch::Device& device) {
  const int rank = pg.rank(), world = pg.size();
  const bool lead = rank == 0;
  auto* zero_opt = dynamic_cast<fsdp::optim::ZeroRedundancyOptimizer*>(opt.get());
  TORCH_INTERNAL_ASSERT((fsdp_model != nullptr) != (zero_opt != nullptr));
  const int64_t total_steps = o.steps ? *o.steps : (o.epochs ? *o.epochs : default_epochs(o.model)) * task.steps_per_epoch();

  // --memory-trace: samples at every unit boundary and optimizer step.
  std::unique_ptr<fsdp::MemoryTracer> tracer;
  if (!o.memory_trace.empty()) {
    TORCH_CHECK(fsdp_model, "fsdp-train: --memory-trace samples FullyShardedDataParallel's units; it does not "
                "apply to --strategy ", o.strategy, " (use full_shard, shard_grad_op, no_shard or hybrid_shard)");
    tracer = std::make_unique<fsdp::MemoryTracer>(*fsdp_model, opt.get());
  }
  if (lead)
    std::fprintf(stderr,
                 "fsdp-train: %s (%lld params, %zu units), %s, %d ranks on %s, %s lr %g, global batch %lld, "
                 "%lld steps\n",
                 o.model.c_str(), (long long)num_params, fsdp_model ? fsdp_model->unit_paths().size() : size_t{0},
                 o.strategy.c_str(), world, device.is_cpu() ? "cpu" : "cuda", o.optimizer.c_str(), o.effective_lr(), (long long)o.batch_size,
                 (long long)total_steps);

  fsdp::trainer::LoopModel lm;
  lm.fsdp = fsdp_model;
  lm.zero = zero_opt;
  lm.optimizer = opt.get();
  lm.module = &module;
  lm.num_params = num_params;
  EvalResult last_eval;
  // The loop's messages in fsdp-train's words: "fsdp-train: --resume auto: skipped: ...".
  fsdp::trainer::LoopNames names;
  names.program = "fsdp-train";
  names.resume = "--resume";
  const fsdp::trainer::FitResult r =
      fsdp::trainer::run_training_loop(loop_options(o, total_steps), pg, lm, loop_data(o, pg, task, forward, device, last_eval),
                                       {std::make_shared<TrainHooks>(o, lead, tracer.get())}, names);

  if (tracer) {
    const auto at = o.memory_trace.find("{rank}");
    if (at != std::string::npos) tracer->dump(std::string(o.memory_trace).replace(at, 6, std::to_string(rank)));
    else if (lead) tracer->dump(o.memory_trace);
  }
  print_summary(o, pg, task, last_eval, r.last_step - r.first_step, r.train_seconds, num_params,
                fsdp::trainer::model_memory(fsdp_model, *opt), phases);
  comm::barrier(pg);
  return 0;
}

// The gpt's shape from the flags (the zero and FSDP paths build the same model).
GptConfig gpt_config(const TrainOptions& o) {
  GptConfig cfg;
  cfg.vocab = kVocabSize;
  cfg.layers = o.layers;
  cfg.dim = o.dim;
  cfg.heads = o.heads;
  cfg.context = o.context;
  return cfg;
}

}  // namespace

int run_rank(const TrainOptions& o) {
  // Before any tensor exists, so that the tracer's "other" category sees every byte.
  if (!o.memory_trace.empty()) fsdp::memory::enable_allocator_counting();
  at::set_num_threads(o.threads);
  auto pg = comm::init_process_group(comm::InitOptions().timeout(std::chrono::milliseconds(
      static_cast<int64_t>(o.timeout_seconds * 1000.0))));
  const int rank = pg.rank(), world = pg.size();

  // Checked on every rank, so each exits non-zero on its own instead of waiting for peers.
  std::string err = check_world_size(o, world);
  if (err.empty()) err = check_device(o);
  if (err.empty() && o.device == "cuda" && pg.cuda_device() < 0)
    err = "--device cuda, but the process group moves no CUDA tensors (some rank has no GPU); give every rank a "
          "GPU, or use --device cpu";
  if (!err.empty()) {
    std::fprintf(stderr, "fsdp-train: error (rank %d): %s\n", rank, err.c_str());
    return 2;
  }
  // The model goes to the rank's device before it is wrapped or handed to ZeRO
  // (FSDP's and ZeRO's contract); each batch follows it there.
  const torch::Device device = o.device == "cuda"
                                   ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(pg.cuda_device()))
                                   : torch::Device(torch::kCPU);

  if (o.is_zero()) {
    // No wrapper: the model as built, the optimizer sharded (it broadcasts rank 0's weights).
    if (o.model == "gpt") {
      auto task = make_text_task(o);
      PhaseMemory phases;
      torch::manual_seed(o.seed);
      Gpt gpt(gpt_config(o));
      checkpoint_blocks(o, *gpt);
      const int64_t num_params = count_params(o, *gpt);
      place(*gpt, device);
      auto opt = make_zero_optimizer(o, pg, gpt.ptr());
      phases.end_construction();
      return train(o, pg, nullptr, *gpt, std::move(opt), [&](const torch::Tensor& x) { return gpt->forward(x); },
                   *task, num_params, phases, device);
    }
    auto task = make_image_task(o);
    PhaseMemory phases;
    torch::manual_seed(o.seed);
    torch::nn::Sequential net = o.model == "cnn" ? make_cnn() : make_mlp(o.hidden);
    const int64_t num_params = count_params(o, *net);
    place(*net, device);
    auto opt = make_zero_optimizer(o, pg, net.ptr());
    phases.end_construction();
    // Under bf16 the parameters are bf16: cast the images as FSDP's cast_forward_inputs does.
    const auto dtype = o.mixed_precision == "bf16" ? torch::kBFloat16 : torch::kFloat;
    return train(o, pg, nullptr, *net, std::move(opt),
                 [&](const torch::Tensor& x) { return net->forward(x.to(dtype)); }, *task, num_params, phases,
                 device);
  }

  // Library options shared by every model; the wrap policy is the model's.
  fsdp::Options base = fsdp::Options()
                           .sharding_strategy(fsdp::parse_sharding_strategy(o.strategy))
                           .shard_group_size(o.shard_group_size)
                           .forward_prefetch(o.forward_prefetch)
                           .bucket_cap_mb(o.bucket_cap_mb)
                           .optimizer_in_backward(o.optimizer_in_backward)
                           .zero_copy_gather(o.zero_copy_gather)
                           .cpu_offload(o.cpu_offload)
                           .gpu_margin_mem_ratio(o.gpu_margin_mem_ratio);
  base.backward_prefetch(o.backward_prefetch == "post"   ? fsdp::BackwardPrefetch::kBackwardPost
                         : o.backward_prefetch == "none" ? fsdp::BackwardPrefetch::kNone
                                                         : fsdp::BackwardPrefetch::kBackwardPre);
  if (o.mixed_precision == "bf16") base.mixed_precision(fsdp::MixedPrecision().param_dtype(torch::kBFloat16));
  // Same seed on every rank right before the model is built: identical initial weights
  // without a broadcast.
  if (o.model == "gpt") {
    auto task = make_text_task(o);
    PhaseMemory phases;  // construction: building the gpt and wrapping it
    torch::manual_seed(o.seed);
    const auto options = fsdp::Options(base).auto_wrap_policy(fsdp::module_type_policy<GptBlockImpl>());
    // Sharded construction: each block is sharded when its constructor returns, so a rank
    // never holds more than one full block (same values as eager construction). It shards
    // on the CPU: --device cuda builds eagerly and moves the model before wrapping.
    const bool eager = o.eager_init || !device.is_cpu();
    Gpt gpt{nullptr};
    int64_t units_at_construction = 0;
    {
      std::optional<fsdp::ShardedInitContext> sharded_init;
      if (!eager) sharded_init.emplace(pg, options);
      gpt = Gpt(gpt_config(o));
      if (sharded_init) units_at_construction = sharded_init->units_sharded();
    }
    checkpoint_blocks(o, *gpt);
    const int64_t num_params = count_params(o, *gpt);
    place(*gpt, device);
    auto model = fsdp::FullyShardedDataParallel(gpt, pg, options);
    phases.end_construction();
    if (rank == 0)
      std::printf("model: %s construction (%lld units sharded as built), construction peak %.1f MiB above the "
                  "resident set before it, peak RSS so far %.1f MiB (rank 0)\n",
                  eager ? "eager" : "sharded", (long long)units_at_construction,
                  double(phases.construction_peak()) / (1 << 20), double(phases.run_peak()) / (1 << 20));
    const int rc = train(o, pg, model.get(), *gpt, make_optimizer(o, model->parameters()),
                         [&](const torch::Tensor& x) { return model->forward(x); }, *task, num_params, phases,
                         device);
    if (rank == 0) std::printf("peak RSS over the run %.1f MiB (rank 0)\n", double(phases.run_peak()) / (1 << 20));
    return rc;
  }
  auto task = make_image_task(o);
  PhaseMemory phases;
  torch::manual_seed(o.seed);
  torch::nn::Sequential net = o.model == "cnn" ? make_cnn() : make_mlp(o.hidden);
  const int64_t num_params = count_params(o, *net);
  place(*net, device);
  auto model = fsdp::FullyShardedDataParallel(
      net, pg,
      fsdp::Options(base).auto_wrap_policy(fsdp::size_based_policy(o.min_num_params)));
  phases.end_construction();
  return train(o, pg, model.get(), *net, make_optimizer(o, model->parameters()),
               [&](const torch::Tensor& x) { return model->forward(x); }, *task, num_params, phases, device);
}

}  // namespace fsdp::train
