#pragma once
/// Which samples each rank trains on, independent of the world size.
///
/// [Note: global batches]
/// torch's DistributedSampler deals indices to ranks round-robin and then batches
/// each rank's share, so the samples that meet in one optimizer step depend on the
/// number of ranks. The Trainer instead cuts the data the way a single process
/// would and only then splits it:
///   1. epoch order: a permutation of [0, size) drawn from (seed, epoch) by a
///      Fisher-Yates shuffle over a 64-bit Mersenne twister (our own arithmetic,
///      identical on every platform and rank), or the identity without shuffle;
///   2. global batches: consecutive runs of `global_batch` indices of that order;
///      the tail (size % global_batch samples) is dropped, or kept as a short last
///      batch (LastBatch in trainer_options.h);
///   3. micro-batches: a global batch of m samples cut into k contiguous parts
///      (part j holds [j*m/k, (j+1)*m/k));
///   4. rank slices: each micro-batch cut the same way into N contiguous parts,
///      part r for rank r.
/// Step s therefore holds the same samples at any world size, which is what makes a
/// run resumed at another world size continue the same data. With equal parts the
/// loss of rank r's part is a mean over the same count everywhere, and the step's
/// loss is the plain mean of the parts' means ([Note: step loss] in
/// src/trainer/step_runner.cpp); with a short batch the parts differ, so the Trainer weights
/// each rank's mean by its count (a plain mean of per-rank means would overweight
/// the small parts). A batch_sampler of one's own (trainer.h) replaces steps 1-2.
/// Torch-free.

#include <cstdint>
#include <utility>
#include <vector>

namespace fsdp::trainer {

/// [begin, end) of part `part` when `n` items are cut into `parts` contiguous parts
/// whose sizes differ by at most one: begin = part*n/parts.
std::pair<int64_t, int64_t> contiguous_part(int64_t n, int64_t parts, int64_t part);

class GlobalSampler {
 public:
  /// `drop_last`: drop the short tail batch (LastBatch::kDrop). Throws c10::Error
  /// on a non-positive global batch or a negative size.
  GlobalSampler(int64_t dataset_size, int64_t global_batch, bool shuffle, uint64_t seed, bool drop_last);

  int64_t dataset_size() const { return size_; }
  int64_t global_batch() const { return batch_; }
  /// Optimizer steps per epoch (0 when drop_last and the set is smaller than a batch).
  int64_t steps_per_epoch() const;
  /// Samples in step `step_in_epoch`'s global batch (global_batch, or less for the tail).
  int64_t batch_samples(int64_t step_in_epoch) const;
  /// Sample indices of that global batch, in epoch `epoch` (the epoch's order is
  /// computed once and kept until another epoch is asked for).
  std::vector<int64_t> batch_indices(int64_t epoch, int64_t step_in_epoch);
  /// The epoch order itself (see [Note: global batches], step 1).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

 private:
  int64_t size_, batch_;
  bool shuffle_, drop_last_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_order_;
};

}  // namespace fsdp::trainer
