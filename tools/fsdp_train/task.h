#pragma once
/// What a model trains on: the global batch of every step and the evaluation set. The
/// training loop (the library's, fsdp::trainer::run_training_loop, driven by
/// train.cpp) is the same for every model; a Task supplies the data: its batch sampler
/// (train_indices) and its samples (train_samples).
///  * image task (mlp, cnn): Fashion-MNIST, see [Note: image batches] in image_task.cpp.
///  * text task (gpt): windows of a byte string, see [Note: text windows] in text_task.cpp.
/// Targets are class indices, one per row of the logits flattened to [-1, classes]
/// (one per image; one per position of a window).

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "options.h"

namespace fsdp::train {

struct Batch {
  torch::Tensor inputs, targets;
};

class Task {
 public:
  virtual ~Task() = default;

  /// Optimizer steps in one epoch (one pass over the training data).
  virtual int64_t steps_per_epoch() const = 0;
  /// Training samples (images; window starts) that train_indices draws from.
  virtual int64_t train_size() const = 0;
  /// The sample indices of step `step`'s (0-based) global batch, in order: the same on
  /// every rank. The loop gives rank r of N the contiguous rank slice [r*B/N, (r+1)*B/N).
  virtual std::vector<int64_t> train_indices(int64_t step) = 0;
  /// The samples `indices` (of train_indices) as one batch.
  virtual Batch train_samples(const std::vector<int64_t>& indices) const = 0;

  /// Items of the evaluation set (images; windows).
  virtual int64_t eval_size() const = 0;
  /// Items per evaluation forward.
  virtual int64_t eval_batch_size() const = 0;
  /// Items [lo, hi) of the evaluation set (lo == hi gives an empty batch of the right shape).
  virtual Batch eval_batch(int64_t lo, int64_t hi) const = 0;

  /// How the summary names the evaluation ("test", "validation next-byte").
  virtual const char* eval_name() const = 0;
  /// What one sample of a batch is ("samples", "windows").
  virtual const char* sample_name() const = 0;
};

/// Fashion-MNIST for --model mlp | cnn. Reads o.data_dir (throws std::runtime_error naming a bad file).
std::unique_ptr<Task> make_image_task(const TrainOptions& o);
/// Bytes of o.text_path for --model gpt (throws std::runtime_error naming the file).
std::unique_ptr<Task> make_text_task(const TrainOptions& o);

}  // namespace fsdp::train
