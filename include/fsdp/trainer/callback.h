#pragma once
/// User hooks into fsdp::trainer::Trainer (Lightning's Callback), and the metrics
/// they receive. Every hook runs on every rank (the values are the same on every
/// rank: global means), between steps, outside any no_sync scope.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/checkpoint.h"

namespace fsdp::trainer {

/// Bytes this rank holds at the end of a step (see the memory summary in trainer.h).
struct MemorySample {
  int64_t param_bytes = 0;           ///< parameter shards (FSDP) or full parameters (zero1/2)
  int64_t grad_bytes = 0;            ///< gradient shards / partition
  int64_t optim_bytes = 0;           ///< optimizer state tensors
  int64_t unsharded_peak_bytes = 0;  ///< FSDP: peak of gathered parameters and unsharded gradients
  int64_t rss_bytes = 0;             ///< resident set of the process
};

struct StepMetrics {
  int64_t step = 0;   ///< optimizer steps done, 1-based (the step just finished)
  int64_t epoch = 0;  ///< 0-based epoch the step belongs to
  double loss = 0;    ///< mean loss over the step's global batch (every micro-batch, every rank; [Note: step loss])
  int64_t samples = 0;  ///< samples in the global batch (less than global_batch_size for a short last batch)
  double lr = 0;      ///< learning rate of parameter group 0 used by this step
  double samples_per_s = 0;
  MemorySample memory;  ///< this rank's
  /// A checkpoint that finished since the previous step's metrics (its step and what it cost
  /// this rank: TrainerOptions::async_checkpoint saves finish while later steps run).
  std::optional<std::pair<int64_t, CheckpointSaveStats>> checkpoint;
};

struct ValidationMetrics {
  int64_t step = 0;
  /// Each key's value: the mean over the whole validation set of the per-batch means
  /// the validation step returned, weighted by the samples of each rank's part.
  std::map<std::string, double> values;
  int64_t samples = 0;
  /// The progress line for this validation (rank 0, stderr). Empty: the loop's own,
  /// "validation after step S: <key> <value> ...". A validation_loop may set it.
  std::string note;
};

/// What on_train_start is told.
struct TrainStart {
  int rank = 0, world_size = 1;
  int64_t first_step = 0;   ///< the step training continues from (0 fresh; S after resuming step-S)
  int64_t total_steps = 0;  ///< the step it ends at
  std::string resumed_from;  ///< the checkpoint directory resumed from ("" when none)
};

class Callback {
 public:
  virtual ~Callback() = default;
  /// After the model, optimizer and a resumed checkpoint are in place.
  virtual void on_train_start(const TrainStart& start) {}
  /// Right after the optimizer (and LR scheduler) stepped for step `step` (1-based),
  /// before anything else of the step's end: a hook that must see every optimizer step
  /// at the moment it happens (fsdp::MemoryTracer::step), which on_step_end, called
  /// once the step's loss is known, does not promise. Its time counts as training time.
  virtual void on_optimizer_step(int64_t step) {}
  virtual void on_step_end(const StepMetrics& metrics) {}
  virtual void on_validation_end(const ValidationMetrics& metrics) {}
  /// After checkpoint `dir` (the state after `step` steps) is complete on disk. With
  /// TrainerOptions::async_checkpoint each rank calls it at the first step boundary where
  /// it sees the save written, which may be a step later on one rank than on another: it
  /// must not issue collectives.
  virtual void on_checkpoint(const std::string& dir, int64_t step) {}
  virtual void on_train_end(const StepMetrics& last) {}
  /// User state saved with every checkpoint: add values and tensors to `extra`
  /// (rank 0's are saved; keys starting with "trainer." are the Trainer's).
  virtual void on_save_checkpoint(CheckpointExtra& extra) {}
  /// The extras of the checkpoint being resumed, on every rank, before on_train_start.
  virtual void on_load_checkpoint(const CheckpointExtra& extra) {}
  /// Whether this callback reads StepMetrics::memory. The loop samples it (which reads
  /// /proc/self/statm) only for a metrics file or a callback that says true.
  virtual bool needs_memory() const { return true; }
};

}  // namespace fsdp::trainer
