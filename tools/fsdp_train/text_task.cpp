#include <random>
#include <vector>

#include <torch/torch.h>

#include "task.h"
#include "text.h"

namespace fsdp::train {

namespace {

// [Note: text windows]
//   The training part of the text has n bytes; T = --context. A *window* is T+1 consecutive
//   bytes starting at `start` in [0, n-T): its first T bytes are the input and its last T
//   the targets (each position predicts the next byte). Step s's global batch is B windows;
//   rank r of N takes windows [r*B/N, (r+1)*B/N). Window i of step s starts at
//     shuffled: the i-th draw rng() % (n-T) of a std::mt19937_64 seeded with (seed, s) alone,
//               so every rank computes the same B starts and a run is reproducible;
//     --no-shuffle: ((s*B + i) * T) mod (n-T), consecutive windows that wrap around.
//   An epoch is max(1, n / (B*T)) steps: about n predicted bytes. Evaluation uses the
//   validation part's non-overlapping windows at starts 0, T, 2T, ... (every byte but the
//   first predicted once, up to a tail shorter than a window); its loss is the mean
//   next-byte cross-entropy and its accuracy the fraction of bytes the argmax predicts.
class TextTask : public Task {
 public:
  explicit TextTask(const TrainOptions& o) : batch_(o.batch_size), context_(o.context), shuffle_(o.shuffle), seed_(o.seed) {
    TextCorpus c = load_text(o.text_path, o.context);
    auto to_tensor = [](std::vector<uint8_t>& bytes) {
      return torch::from_blob(bytes.data(), {int64_t(bytes.size())}, torch::kUInt8).clone();
    };
    train_bytes_ = int64_t(c.train.size());
    // Views, no copies: row j of unfold(0, T+1, step) is the window starting at j*step.
    train_windows_ = to_tensor(c.train).unfold(0, context_ + 1, 1);
    eval_windows_ = to_tensor(c.validation).unfold(0, context_ + 1, context_);
  }

  int64_t steps_per_epoch() const override { return std::max<int64_t>(1, train_bytes_ / (batch_ * context_)); }

  int64_t train_size() const override { return train_windows_.size(0); }
  std::vector<int64_t> train_indices(int64_t step) override {
    const uint64_t starts = uint64_t(train_windows_.size(0));  // n - T
    std::vector<int64_t> idx;
    idx.reserve(size_t(batch_));
    if (shuffle_) {
      std::seed_seq seq{uint64_t(seed_), uint64_t(seed_ >> 32), uint64_t(step)};
      std::mt19937_64 rng(seq);
      for (int64_t i = 0; i < batch_; ++i) idx.push_back(int64_t(rng() % starts));
    } else {
      for (int64_t i = 0; i < batch_; ++i) idx.push_back(int64_t(uint64_t((step * batch_ + i) * context_) % starts));
    }
    return idx;
  }
  Batch train_samples(const std::vector<int64_t>& indices) const override {
    return split(train_windows_.index_select(0, torch::tensor(indices, torch::kInt64)));
  }

  int64_t eval_size() const override { return eval_windows_.size(0); }
  int64_t eval_batch_size() const override { return 64; }
  Batch eval_batch(int64_t lo, int64_t hi) const override { return split(eval_windows_.slice(0, lo, hi)); }

  const char* eval_name() const override { return "validation next-byte"; }
  const char* sample_name() const override { return "windows"; }

 private:
  /// Windows [b, T+1] of bytes -> inputs [b, T] and targets [b, T], int64.
  Batch split(const torch::Tensor& windows) const {
    auto w = windows.to(torch::kInt64);
    return {w.slice(1, 0, context_), w.slice(1, 1, context_ + 1)};
  }

  int64_t batch_, context_;
  bool shuffle_;
  uint64_t seed_;
  int64_t train_bytes_ = 0;
  torch::Tensor train_windows_, eval_windows_;
};

}  // namespace

std::unique_ptr<Task> make_text_task(const TrainOptions& o) { return std::make_unique<TextTask>(o); }

}  // namespace fsdp::train
