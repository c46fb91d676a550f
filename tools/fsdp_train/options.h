#pragma once
/// fsdp-train's command line: every flag typed, defaulted and checked here, before any
/// rank starts, so a typo fails in well under a second with the flag and the fix instead
/// of after a rendezvous (or, worse, half-way through an epoch).

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp::train {

inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";
/// Measured on the 2-core machine (mlp, Adam 1e-3, batch 64, seeds 0 and 1): test accuracy
/// 84.5-85.1% after 1 epoch, 84.9% after 2 (the last step lands on a noisy point), 86.9-87.1%
/// after 3, at about 50 s in all. 3 is the smallest count that clears 85% on every seed tried.
inline constexpr int64_t kDefaultEpochs = 3;
/// cnn: 86.2% test accuracy after 1 epoch (937 steps, 30 s of training on the loaded 2-core
/// machine, seed 0): already past the mlp's 3 epochs, in less time.
inline constexpr int64_t kDefaultCnnEpochs = 1;
/// gpt (defaults, GPL-3, 15 steps per epoch): validation loss 2.76 nats/byte after 200 steps,
/// 2.57 after 400, 2.34 (37.0% of next bytes right) after 600 in 40 s, still falling;
/// 3 epochs (45 steps) would stop at a training loss of ~3.0, about what byte frequencies
/// alone give (3.1 nats on the training part, 3.5 on validation).
inline constexpr int64_t kDefaultGptEpochs = 40;

/// The epoch count when neither --steps nor --epochs is given.
inline int64_t default_epochs(const std::string& model) {
  return model == "gpt" ? kDefaultGptEpochs : model == "cnn" ? kDefaultCnnEpochs : kDefaultEpochs;
}
/// The gpt's corpus when --text is not given: present on every Debian system (35 kB).
inline constexpr const char* kDefaultTextFile = "/usr/share/common-licenses/GPL-3";

struct TrainOptions {
  int nproc = 2;                   ///< ranks started when not already under a launcher
  /// Rendezvous and collective timeout; a peer silent this long fails the collective.
  double timeout_seconds = 300;
  int threads = 1;                 ///< at::set_num_threads per rank (2 cores, 2 ranks)
  std::string device = "cpu";      ///< cpu | cuda (the rank's GPU, ProcessGroup::cuda_device())
  std::string model = "mlp";       ///< mlp | cnn (Fashion-MNIST) | gpt (bytes of a text file)
  int64_t hidden = 512;            ///< mlp only
  std::string data_dir = kDefaultDataDir;  ///< mlp, cnn
  std::string text_path = kDefaultTextFile;  ///< gpt: the corpus, 90% train / 10% validation
  int64_t layers = 2;              ///< gpt: transformer blocks (one FSDP unit each)
  int64_t dim = 64;                ///< gpt: model width
  int64_t heads = 4;               ///< gpt: attention heads, dividing dim
  int64_t context = 64;            ///< gpt: window length in bytes
  std::string strategy = "full_shard";
  int shard_group_size = 0;        ///< hybrid_shard: ranks per shard group (0: ranks per machine)
  std::string optimizer = "adam";  ///< sgd | adam | adamw | cpu_adam
  std::optional<double> lr;        ///< default per optimizer, see effective_lr()
  double weight_decay = 0.0;
  double momentum = 0.9;           ///< sgd only
  int64_t min_num_params = 1000;   ///< mlp, cnn auto-wrap threshold: every Linear/Conv2d is a unit
  int64_t batch_size = 64;         ///< global: split evenly across ranks (gpt default: 32 windows)
  std::optional<int64_t> steps;    ///< exclusive with --epochs
  std::optional<int64_t> epochs;   ///< default_epochs(model) when neither is given
  uint64_t seed = 0;
  int64_t eval_every = 0;          ///< 0: evaluate once, at the end
  int64_t log_every = 100;
  bool shuffle = true;
  std::string metrics_path;        ///< JSON lines, rank 0; empty: none
  bool estimate_memory = false;
  std::string mixed_precision = "none";  ///< none | bf16 (bf16 compute and gathers, fp32 master)
  std::string backward_prefetch = "pre";  ///< pre | post | none (fsdp::Options::backward_prefetch)
  bool forward_prefetch = false;          ///< fsdp::Options::forward_prefetch
  bool optimizer_in_backward = false;     ///< fsdp::Options::optimizer_in_backward
  bool zero_copy_gather = false;          ///< fsdp::Options::zero_copy_gather
  bool cpu_offload = false;               ///< fsdp::Options::cpu_offload, ZeroOptions::cpu_offload
  double gpu_margin_mem_ratio = 0;        ///< fsdp::Options / ZeroOptions::gpu_margin_mem_ratio (placement auto)
  double bucket_cap_mb = 0;               ///< fsdp::Options::bucket_cap_mb (<= 0: off)
  std::string memory_trace;               ///< JSON lines of fsdp::MemoryTracer samples ("{rank}": one file per rank)
  bool activation_checkpointing = false;  ///< gpt: recompute each block's activations in backward
  bool eager_init = false;                ///< gpt: build the whole model, then shard (no ShardedInitContext)
  std::string checkpoint_dir;      ///< checkpoints go to <dir>/step-S; empty: none
  int64_t checkpoint_every = 0;    ///< also every K steps (0: only step-0 and the last step)
  std::string resume;              ///< a checkpoint directory (<dir>/step-S) to continue from, or "auto"; empty: none
  bool async_checkpoint = true;    ///< fsdp::trainer::TrainerOptions::async_checkpoint
  std::string init_from;           ///< safetensors file, index or directory a fresh run starts from; empty: none
  std::string export_safetensors;  ///< directory the final weights go to as safetensors; empty: none
  int64_t export_max_shard_bytes = 5'000'000'000;  ///< above it, a sharded set with an index
  int64_t keep_checkpoints = 2;    ///< keep only the K newest <dir>/step-S (0: keep all); 2 bounds the disk a long run uses

  /// 1e-3 for the Adam family, 0.05 for SGD.
  double effective_lr() const;
  /// zero1 / zero2: an unwrapped model trained by fsdp::optim::ZeroRedundancyOptimizer.
  bool is_zero() const { return strategy == "zero1" || strategy == "zero2"; }
};

enum class ParseOutcome { Run, Help, UsageError };

struct ParseResult {
  ParseOutcome outcome = ParseOutcome::UsageError;
  TrainOptions options;
  std::string message;  ///< help text, or what was wrong and how to fix it
};

/// Parses and validates everything that does not depend on the world size
/// (see check_world_size) or on the input files (see check_inputs).
ParseResult parse_command_line(int argc, const char* const* argv);

/// Empty if the global batch splits evenly over `world_size` ranks, else the message.
std::string check_world_size(const TrainOptions& o, int world_size);
/// Empty if the model's inputs are usable, else the message: mlp and cnn need the four
/// Fashion-MNIST files readable in o.data_dir; gpt needs o.text_path readable and long
/// enough for one window of context+1 bytes in each of its train and validation parts.
std::string check_inputs(const TrainOptions& o);
/// Empty if o.device can train on this machine (--device cuda: torch sees a CUDA device),
/// else the message and the fix.
std::string check_device(const TrainOptions& o);

}  // namespace fsdp::train
