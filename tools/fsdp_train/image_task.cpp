#include <numeric>
#include <random>
#include <vector>

#include <torch/torch.h>

#include "mnist.h"
#include "task.h"

namespace fsdp::train {

namespace {

// [Note: image batches]
//   A *global batch* of B samples is one optimizer step; rank r of N takes the contiguous
//   *rank slice* i in [r*B/N, (r+1)*B/N). Sample i of step s is, within epoch e = s / S
//   (S = floor(60000/B) steps per epoch), perm_e[(s mod S)*B + i] with shuffling, or
//   (s*B + i) mod 60000 without (which then wraps across epochs). perm_e comes from a
//   std::mt19937_64 seeded with (seed, e) alone, so every rank draws the same order and
//   a run is reproducible. The loss of a step is the mean over the global batch: the
//   average of the rank slices' mean losses (all slices have B/N samples).
class Sampler {
 public:
  Sampler(int64_t dataset_size, int64_t batch, bool shuffle, uint64_t seed)
      : n_(dataset_size), batch_(batch), shuffle_(shuffle), seed_(seed), steps_per_epoch_(dataset_size / batch) {}

  int64_t steps_per_epoch() const { return steps_per_epoch_; }

  /// Global indices [begin, end) of step s (0-based).
  std::vector<int64_t> indices(int64_t s, int64_t begin, int64_t end) {
    std::vector<int64_t> out;
    out.reserve(size_t(end - begin));
    if (!shuffle_) {
      for (int64_t i = begin; i < end; ++i) out.push_back((s * batch_ + i) % n_);
      return out;
    }
    int64_t epoch = s / steps_per_epoch_;
    if (epoch != perm_epoch_) make_perm(epoch);
    int64_t base = (s % steps_per_epoch_) * batch_;
    for (int64_t i = begin; i < end; ++i) out.push_back(perm_[size_t(base + i)]);
    return out;
  }

 private:
  void make_perm(int64_t epoch) {
    std::seed_seq seq{uint64_t(seed_), uint64_t(seed_ >> 32), uint64_t(epoch)};
    std::mt19937_64 rng(seq);
    perm_.resize(size_t(n_));
    std::iota(perm_.begin(), perm_.end(), 0);
    // Fisher-Yates with rng() % k rather than std::shuffle/uniform_int_distribution, whose
    // outputs the standard leaves to the library: the order must not depend on it.
    for (int64_t i = n_ - 1; i > 0; --i) std::swap(perm_[size_t(i)], perm_[size_t(rng() % uint64_t(i + 1))]);
    perm_epoch_ = epoch;
  }

  int64_t n_, batch_;
  bool shuffle_;
  uint64_t seed_;
  int64_t steps_per_epoch_;
  int64_t perm_epoch_ = -1;
  std::vector<int64_t> perm_;
};

/// Pixels as uint8 [count, 784] and labels as int64 [count]; batches are converted to
/// float in [0,1] on the fly (a float copy of the train set would be 188 MB per rank).
struct TensorSplit {
  torch::Tensor pixels, labels;
};

TensorSplit to_tensors(Split s) {
  auto count = s.images.count;
  auto px = torch::from_blob(s.images.pixels.data(), {count, s.images.rows * s.images.cols}, torch::kUInt8).clone();
  auto lb = torch::from_blob(s.labels.data(), {count}, torch::kUInt8).to(torch::kInt64);
  return {px, lb};
}

class ImageTask : public Task {
 public:
  explicit ImageTask(const TrainOptions& o)
      : train_(to_tensors(load_split(o.data_dir, "train"))),
        test_(to_tensors(load_split(o.data_dir, "t10k"))),
        sampler_(train_.labels.size(0), o.batch_size, o.shuffle, o.seed), batch_(o.batch_size) {}

  int64_t steps_per_epoch() const override { return sampler_.steps_per_epoch(); }

  int64_t train_size() const override { return train_.labels.size(0); }
  std::vector<int64_t> train_indices(int64_t step) override { return sampler_.indices(step, 0, batch_); }
  Batch train_samples(const std::vector<int64_t>& indices) const override {
    auto idx = torch::tensor(indices, torch::kInt64);
    return {train_.pixels.index_select(0, idx).to(torch::kFloat32).div_(255.0), train_.labels.index_select(0, idx)};
  }

  int64_t eval_size() const override { return test_.labels.size(0); }
  int64_t eval_batch_size() const override { return 1000; }
  Batch eval_batch(int64_t lo, int64_t hi) const override {
    return {test_.pixels.slice(0, lo, hi).to(torch::kFloat32).div_(255.0), test_.labels.slice(0, lo, hi)};
  }

  const char* eval_name() const override { return "test"; }
  const char* sample_name() const override { return "samples"; }

 private:
  TensorSplit train_, test_;
  Sampler sampler_;
  int64_t batch_;
};

}  // namespace

std::unique_ptr<Task> make_image_task(const TrainOptions& o) { return std::make_unique<ImageTask>(o); }

}  // namespace fsdp::train
