#include "options.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <tuple>

#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <torch/cuda.h>

#include "text.h"

namespace fsdp::train {

namespace {

const char* const kDataFiles[] = {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                  "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"};

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

ParseResult usage_error(std::string message) {
  ParseResult r;
  r.outcome = ParseOutcome::UsageError;
  r.message = std::move(message);
  return r;
}

}  // namespace

double TrainOptions::effective_lr() const {
  if (lr) return *lr;
  return optimizer == "sgd" ? 0.05 : 1e-3;
}

ParseResult parse_command_line(int argc, const char* const* argv) {
  TrainOptions o;
  CLI::App app{
      "fsdp-train: trains a model with FullyShardedDataParallel: an mlp or a cnn on Fashion-MNIST,\n"
      "or a byte-level gpt on a text file (--text, default " + std::string(kDefaultTextFile) + ").\n"
      "Started directly, it re-executes itself under fsdp-run (next to it) with --nproc ranks;\n"
      "under a launcher (fsdp-run, torchrun, srun, mpirun) it joins the job.",
      "fsdp-train"};
  double lr = 0;
  int64_t steps = 0, epochs = 0;
  bool no_shuffle = false;

  app.add_option("--nproc", o.nproc, "ranks to start when not under a launcher")->capture_default_str();
  app.add_option("--timeout", o.timeout_seconds,
                 "seconds the rendezvous and each collective wait for a peer before failing")
      ->capture_default_str();
  app.add_option("--threads", o.threads, "intra-op threads per rank")->capture_default_str();
  app.add_option("--device", o.device,
                 "cpu | cuda: where each rank trains (cuda: the rank's GPU, its local rank modulo the visible "
                 "GPUs; the model is built whole on the CPU, moved there, then wrapped, as with --eager-init; "
                 "NCCL when every rank has a GPU of its own, Gloo when ranks share one; not with --optimizer "
                 "cpu_adam)")
      ->capture_default_str();
  app.add_option("--model", o.model,
                 "mlp | cnn (both on Fashion-MNIST) | gpt (decoder-only transformer on the bytes of --text)")
      ->capture_default_str();
  auto* hidden_opt = app.add_option("--hidden", o.hidden, "hidden width of the mlp")->capture_default_str();
  auto* data_opt = app.add_option("--data", o.data_dir, "mlp, cnn: directory of the gzip'd Fashion-MNIST IDX files")
                       ->capture_default_str();
  auto* text_opt =
      app.add_option("--text", o.text_path,
                     "gpt: text file to train on, byte-level (first 90% train, last 10% validation); "
                     "the default is on every Debian system")
          ->capture_default_str();
  auto* layers_opt = app.add_option("--layers", o.layers, "gpt: transformer blocks (one FSDP unit each)")
                         ->capture_default_str();
  auto* dim_opt = app.add_option("--dim", o.dim, "gpt: model width")->capture_default_str();
  auto* heads_opt = app.add_option("--heads", o.heads, "gpt: attention heads (must divide --dim)")
                        ->capture_default_str();
  auto* context_opt = app.add_option("--context", o.context, "gpt: window length in bytes (positions)")
                          ->capture_default_str();
  app.add_option("--strategy", o.strategy,
                 "full_shard | shard_grad_op | no_shard | hybrid_shard | zero1 | zero2 (ZeRO without a wrapper: "
                 "fsdp::optim::ZeroRedundancyOptimizer)")
      ->capture_default_str();
  auto* group_opt = app.add_option("--shard-group-size", o.shard_group_size,
                                   "hybrid_shard: ranks per shard group, consecutive (default: ranks per machine)");
  app.add_option("--optimizer", o.optimizer, "sgd | adam | adamw | cpu_adam")->capture_default_str();
  auto* lr_opt = app.add_option("--lr", lr, "learning rate (default 1e-3, sgd 0.05)");
  app.add_option("--weight-decay", o.weight_decay, "L2 (sgd, adam, cpu_adam) or decoupled (adamw)")
      ->capture_default_str();
  app.add_option("--momentum", o.momentum, "sgd momentum")->capture_default_str();
  auto* min_params_opt =
      app.add_option("--min-num-params", o.min_num_params,
                     "mlp, cnn: auto-wrap threshold (parameters per unit); gpt: one unit per block")
          ->capture_default_str();
  auto* batch_opt =
      app.add_option("--batch-size", o.batch_size,
                     "global batch size (gpt: windows of --context+1 bytes), divisible by the world size "
                     "(default 64; gpt: 32)");
  auto* steps_opt = app.add_option("--steps", steps, "optimizer steps to run");
  auto* epochs_opt =
      app.add_option("--epochs", epochs, "epochs to run (default 3; cnn 1; gpt 40, i.e. 600 steps on the default text)");
  steps_opt->excludes(epochs_opt);
  app.add_option("--seed", o.seed, "seed of initial weights and shuffling")->capture_default_str();
  app.add_option("--eval-every", o.eval_every, "evaluate every K steps (0: only at the end)")
      ->capture_default_str();
  app.add_option("--log-every", o.log_every, "progress line every K steps")->capture_default_str();
  app.add_flag("--no-shuffle", no_shuffle,
               "step s uses samples (s*B+i) mod 60000 (gpt: consecutive windows instead of random ones)");
  app.add_option("--metrics", o.metrics_path, "rank 0 writes JSON lines (per step and per eval; format: include/fsdp/trainer/metrics_log.h)");
  app.add_flag("--estimate-memory", o.estimate_memory,
               "print model-state bytes per rank for each strategy, this run's construction peak and "
               "training peak, and exit");
  app.add_option("--mixed-precision", o.mixed_precision,
                 "none | bf16 (bf16 gathers and compute, fp32 master weights and optimizer)")
      ->capture_default_str();
  app.add_option("--backward-prefetch", o.backward_prefetch,
                 "gather the next unit before (pre) or after (post) this unit's gradients, or not at all (none)")
      ->capture_default_str();
  app.add_flag("--forward-prefetch", o.forward_prefetch,
               "gather the next unit during this unit's forward (order of the previous step)");
  app.add_flag("--optimizer-in-backward", o.optimizer_in_backward,
               "step each unit's shard with the optimizer inside backward, as its reduction completes "
               "(same results; FSDP: gradients freed unit by unit; zero2: each bucket's chunk; not zero1)");
  app.add_flag("--zero-copy-gather", o.zero_copy_gather,
               "on one host, gather each unit's parameters by mapping the other ranks' shards instead of "
               "copying them (same results; sharded FSDP strategies on the CPU, without --mixed-precision bf16 "
               "or --offload-params)");
  app.add_flag("--offload-params,--cpu-offload", o.cpu_offload,
               "keep each unit's fp32 shard, its gradients and the optimizer state in host memory; only "
               "compute-dtype copies visit the device (zero1/zero2: this rank's partition; pair with "
               "--optimizer cpu_adam)");
  app.add_option("--gpu-margin-mem-ratio", o.gpu_margin_mem_ratio,
                 "with --offload-params (and --optimizer-in-backward for the FSDP strategies): after the first "
                 "step, move units' (zero1/zero2: buckets') shards and optimizer state back to the GPU while they "
                 "fit in this fraction of the memory the step left free (placement auto)")
      ->capture_default_str();
  app.add_option("--memory-trace", o.memory_trace,
                 "write bytes by category at every unit boundary and optimizer step (fsdp::MemoryTracer) as "
                 "JSON lines to FILE (rank 0; put {rank} in the name for one file per rank); render with "
                 "tools/plot_memory_trace.py");
  auto* checkpointing_opt =
      app.add_flag("--activation-checkpointing", o.activation_checkpointing,
                   "gpt: keep only each block's input in forward and recompute the block in backward "
                   "(fsdp::apply_activation_checkpointing): less activation memory for one more forward");
  app.add_flag("--eager-init", o.eager_init,
               "gpt: build the whole model on every rank before sharding it (default: each block is "
               "sharded as it is constructed, fsdp::ShardedInitContext; same initial values)");
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb,
                 "reduce consecutive units' gradients together up to this many MiB (0: one collective per unit)")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "write checkpoints (docs/checkpoint-format.md) to DIR/step-S, S = optimizer steps taken: "
                 "DIR/step-0 before the first step, every --checkpoint-every steps, and after the last step");
  auto* every_opt =
      app.add_option("--checkpoint-every", o.checkpoint_every,
                     "with --checkpoint-dir: also checkpoint every K steps (0: only step-0 and the last step)")
          ->capture_default_str();
  auto* keep_opt =
      app.add_option("--keep-checkpoints", o.keep_checkpoints,
                     "with --checkpoint-dir: after each save, delete all but the K newest DIR/step-S (0: keep all)")
          ->capture_default_str();
  app.add_flag("--async-checkpoint,!--no-async-checkpoint", o.async_checkpoint,
               "with --checkpoint-dir: write each checkpoint on a writer thread while training goes on "
               "(default; it appears at the first step after it is written); --no-async-checkpoint: "
               "training waits for each save");
  app.add_option("--resume", o.resume,
                 "continue from a checkpoint DIR/step-S written by --checkpoint-dir (or 'auto': the newest usable "
                 "one under --checkpoint-dir, none: start fresh): weights, optimizer state, "
                 "data position (step S) and torch's CPU RNG, so later losses equal an uninterrupted run's; "
                 "any world size and strategy. --steps/--epochs still count from the run's start. The flags "
                 "that decide the model and the data (--model and its shape flags, --seed, --batch-size, "
                 "--no-shuffle, --optimizer, --lr) must equal the checkpoint's; a difference is refused. "
                 "(fp32 and bf16 training use no loss scaler, so there is none to restore.)");

  app.add_option("--init-from", o.init_from,
                 "start from these weights: a safetensors file (Hugging Face's format), a sharded set's "
                 "model.safetensors.index.json, a directory holding either, or a PyTorch DCP directory "
                 "(dcp.save of {\"model\": ...}); names must be the model's "
                 "(fsdp-train's --export-safetensors writes them). Each rank reads only its shards' bytes. "
                 "A resumed run continues its checkpoint's weights instead");
  app.add_option("--export-safetensors", o.export_safetensors,
                 "after the last step, write the weights to directory DIR as safetensors: DIR/model.safetensors, "
                 "or above 5 GB a sharded set with DIR/model.safetensors.index.json (Python: "
                 "safetensors.torch.load_file). With --steps 0: convert --init-from without training");
  app.add_option("--export-max-shard-bytes", o.export_max_shard_bytes,
                 "with --export-safetensors: above this many bytes, files of at most this size and their index "
                 "(transformers' max_shard_size)")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    ParseResult r;
    r.outcome = ParseOutcome::Help;
    r.message = app.help();
    return r;
  } catch (const CLI::ParseError& e) {
    return usage_error(std::string(e.what()) + " (see fsdp-train --help)");
  }

  if (lr_opt->count() > 0) o.lr = lr;
  if (steps_opt->count() > 0) o.steps = steps;
  if (epochs_opt->count() > 0) o.epochs = epochs;
  o.shuffle = !no_shuffle;
  o.model = lower(o.model);
  o.strategy = lower(o.strategy);
  o.optimizer = lower(o.optimizer);
  o.mixed_precision = lower(o.mixed_precision);
  o.backward_prefetch = lower(o.backward_prefetch);
  o.device = lower(o.device);

  if (o.nproc < 1) return usage_error("--nproc must be >= 1, got " + std::to_string(o.nproc));
  if (!(o.timeout_seconds > 0 && o.timeout_seconds <= 1e6)) {
    return usage_error("--timeout must be a number of seconds in (0, 1000000], got " +
                       std::to_string(o.timeout_seconds));
  }
  if (o.threads < 1) return usage_error("--threads must be >= 1, got " + std::to_string(o.threads));
  if (o.model != "mlp" && o.model != "cnn" && o.model != "gpt")
    return usage_error("unknown --model '" + o.model + "'; expected mlp, cnn or gpt");
  // A flag the chosen model ignores is almost always a mistake (a forgotten --model gpt).
  auto only_for = [&](CLI::Option* opt, bool applies, const char* models) -> std::string {
    if (opt->count() == 0 || applies) return "";
    return opt->get_name() + " applies to --model " + models + " only, not --model " + o.model +
           "; drop it or pick that model";
  };
  const bool gpt = o.model == "gpt";
  for (auto [opt, applies, models] :
       {std::tuple{hidden_opt, o.model == "mlp", "mlp"}, std::tuple{data_opt, !gpt, "mlp and cnn"},
        std::tuple{min_params_opt, !gpt, "mlp and cnn"}, std::tuple{text_opt, gpt, "gpt"},
        std::tuple{layers_opt, gpt, "gpt"}, std::tuple{dim_opt, gpt, "gpt"}, std::tuple{heads_opt, gpt, "gpt"},
        std::tuple{context_opt, gpt, "gpt"}, std::tuple{checkpointing_opt, gpt, "gpt"}})
    if (std::string e = only_for(opt, applies, models); !e.empty()) return usage_error(e);
  if (o.hidden < 1) return usage_error("--hidden must be >= 1, got " + std::to_string(o.hidden));
  if (o.layers < 1) return usage_error("--layers must be >= 1, got " + std::to_string(o.layers));
  if (o.dim < 1) return usage_error("--dim must be >= 1, got " + std::to_string(o.dim));
  if (o.heads < 1) return usage_error("--heads must be >= 1, got " + std::to_string(o.heads));
  if (o.dim % o.heads != 0)
    return usage_error("--dim " + std::to_string(o.dim) + " does not divide into --heads " + std::to_string(o.heads) +
                       " (each head gets dim/heads channels); pick --heads dividing --dim, e.g. --dim " +
                       std::to_string((o.dim / o.heads + 1) * o.heads) + " --heads " + std::to_string(o.heads));
  if (o.context < 1) return usage_error("--context must be >= 1, got " + std::to_string(o.context));
  if (gpt && batch_opt->count() == 0) o.batch_size = 32;
  if (o.strategy != "full_shard" && o.strategy != "shard_grad_op" && o.strategy != "no_shard" &&
      o.strategy != "hybrid_shard" && o.strategy != "zero1" && o.strategy != "zero2")
    return usage_error("unknown --strategy '" + o.strategy +
                       "'; expected full_shard, shard_grad_op, no_shard, hybrid_shard, zero1 or zero2");
  if (o.optimizer_in_backward && o.strategy == "zero1")
    return usage_error("--optimizer-in-backward needs gradients reduced during backward: the FSDP strategies or "
                       "zero2, not --strategy zero1 (it reduces in the step)");
  if (o.zero_copy_gather && (o.strategy == "zero1" || o.strategy == "zero2" || o.strategy == "no_shard"))
    return usage_error("--zero-copy-gather maps the sharded parameters FSDP gathers: --strategy full_shard, "
                       "shard_grad_op or hybrid_shard, not " + o.strategy);
  if (o.zero_copy_gather && (o.mixed_precision != "none" || o.cpu_offload))
    return usage_error("--zero-copy-gather maps the other ranks' shards as they are; " +
                       std::string(o.cpu_offload ? "--offload-params keeps them away from the device"
                                                    : "--mixed-precision " + o.mixed_precision + " gathers a cast copy") +
                       ": drop one of the two");
  if (group_opt->count() > 0 && o.strategy != "hybrid_shard")
    return usage_error("--shard-group-size applies to --strategy hybrid_shard only");
  if (o.shard_group_size < 0)
    return usage_error("--shard-group-size must be >= 1 (or 0 for ranks per machine), got " +
                       std::to_string(o.shard_group_size));
  if (o.optimizer != "sgd" && o.optimizer != "adam" && o.optimizer != "adamw" && o.optimizer != "cpu_adam")
    return usage_error("unknown --optimizer '" + o.optimizer + "'; expected sgd, adam, adamw or cpu_adam");
  if (o.effective_lr() <= 0) return usage_error("--lr must be > 0");
  if (o.device != "cpu" && o.device != "cuda")
    return usage_error("unknown --device '" + o.device + "'; expected cpu or cuda");
  if (o.device == "cuda" && o.optimizer == "cpu_adam" && !o.cpu_offload)
    return usage_error("--optimizer cpu_adam steps host memory; with --device cuda use --optimizer adam (or adamw), "
                       "or add --offload-params to keep the optimizer's shards on the host");
  if (o.weight_decay < 0) return usage_error("--weight-decay must be >= 0");
  if (o.momentum < 0) return usage_error("--momentum must be >= 0");
  if (o.min_num_params < 0) return usage_error("--min-num-params must be >= 0");
  if (o.batch_size < 1) return usage_error("--batch-size must be >= 1, got " + std::to_string(o.batch_size));
  if (o.steps && *o.steps < 0) return usage_error("--steps must be >= 0");
  if (o.export_max_shard_bytes < 1) return usage_error("--export-max-shard-bytes must be >= 1");
  if (o.steps && *o.steps == 0 && o.export_safetensors.empty())
    return usage_error("--steps 0 trains nothing; with --export-safetensors DIR it converts --init-from (or the "
                       "initial weights) to safetensors");
  if (o.epochs && *o.epochs < 1) return usage_error("--epochs must be >= 1");
  if (o.eval_every < 0) return usage_error("--eval-every must be >= 0");
  if (o.log_every < 1) return usage_error("--log-every must be >= 1");
  if (o.mixed_precision != "none" && o.mixed_precision != "bf16")
    return usage_error("unknown --mixed-precision '" + o.mixed_precision + "'; expected none or bf16");
  if (o.backward_prefetch != "pre" && o.backward_prefetch != "post" && o.backward_prefetch != "none")
    return usage_error("unknown --backward-prefetch '" + o.backward_prefetch + "'; expected pre, post or none");
  if (!(o.bucket_cap_mb < 1e12)) return usage_error("--bucket-cap-mb must be a finite number of MiB (<= 0: off)");
  if (!(o.gpu_margin_mem_ratio >= 0 && o.gpu_margin_mem_ratio <= 1))
    return usage_error("--gpu-margin-mem-ratio must be in [0, 1]");
  if (o.gpu_margin_mem_ratio > 0 && !o.cpu_offload)
    return usage_error("--gpu-margin-mem-ratio places offloaded state back on the GPU; add --offload-params");
  if (o.gpu_margin_mem_ratio > 0 && !o.optimizer_in_backward && o.strategy.rfind("zero", 0) != 0)
    return usage_error("--gpu-margin-mem-ratio with --strategy " + o.strategy + " needs --optimizer-in-backward "
                       "(FSDP moves each unit's optimizer state with it, and knows the optimizer only when it "
                       "steps it in backward)");
  if (o.keep_checkpoints < 0)
    return usage_error("--keep-checkpoints must be >= 0 (0: keep all), got " + std::to_string(o.keep_checkpoints));
  if (keep_opt->count() > 0 && o.checkpoint_dir.empty())
    return usage_error("--keep-checkpoints needs --checkpoint-dir");
  if (o.resume == "auto" && o.checkpoint_dir.empty())
    return usage_error("--resume auto needs --checkpoint-dir DIR (it continues from the newest DIR/step-S)");
  if (o.checkpoint_every < 0)
    return usage_error("--checkpoint-every must be >= 0, got " + std::to_string(o.checkpoint_every));
  if (every_opt->count() > 0 && o.checkpoint_dir.empty())
    return usage_error("--checkpoint-every needs --checkpoint-dir DIR (where the checkpoints go)");

  ParseResult r;
  r.outcome = ParseOutcome::Run;
  r.options = std::move(o);
  return r;
}

std::string check_world_size(const TrainOptions& o, int world_size) {
  if (o.strategy == "hybrid_shard" && o.shard_group_size > 0 && world_size % o.shard_group_size != 0)
    return "--shard-group-size " + std::to_string(o.shard_group_size) + " does not divide the world size " +
           std::to_string(world_size) + "; pick a divisor of " + std::to_string(world_size);
  if (o.batch_size % world_size == 0) return "";
  std::ostringstream msg;
  msg << "--batch-size " << o.batch_size << " does not divide by the world size " << world_size
      << "; use a multiple of " << world_size << " (e.g. " << (o.batch_size / world_size + 1) * world_size
      << ")";
  return msg.str();
}

namespace {

std::string check_text_file(const TrainOptions& o) {
  struct stat st {};
  if (stat(o.text_path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || !std::ifstream(o.text_path).good())
    return "--text " + o.text_path + ": cannot read the file; point --text at a readable text file (default " +
           kDefaultTextFile + ")";
  return check_text_size(o.text_path, int64_t(st.st_size), o.context);
}

std::string check_data_dir(const TrainOptions& o) {
  for (const char* name : kDataFiles) {
    std::string path = o.data_dir + "/" + name;
    if (!std::ifstream(path).good())
      return "cannot read " + path + " (--data " + o.data_dir +
             "): point --data at the directory of the Fashion-MNIST IDX .gz files "
             "(Debian: apt-get install dataset-fashion-mnist)";
  }
  return "";
}

}  // namespace

std::string check_inputs(const TrainOptions& o) {
  return o.model == "gpt" ? check_text_file(o) : check_data_dir(o);
}

std::string check_device(const TrainOptions& o) {
  if (o.device != "cuda" || torch::cuda::is_available()) return "";
  return "--device cuda: torch sees no CUDA device on this machine (no GPU or NVIDIA driver, CUDA_VISIBLE_DEVICES "
         "hides them, or libtorch was built without CUDA); use --device cpu, or run where a GPU is visible";
}

}  // namespace fsdp::train
