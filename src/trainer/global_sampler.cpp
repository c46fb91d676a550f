#include "fsdp/trainer/global_sampler.h"

#include <random>

#include <c10/util/Exception.h>

namespace fsdp::trainer {

std::pair<int64_t, int64_t> contiguous_part(int64_t n, int64_t parts, int64_t part) {
  TORCH_INTERNAL_ASSERT(parts > 0 && part >= 0 && part < parts && n >= 0);
  return {part * n / parts, (part + 1) * n / parts};
}

GlobalSampler::GlobalSampler(int64_t dataset_size, int64_t global_batch, bool shuffle, uint64_t seed,
                             bool drop_last)
    : size_(dataset_size), batch_(global_batch), shuffle_(shuffle), drop_last_(drop_last), seed_(seed) {
  TORCH_CHECK(global_batch > 0, "GlobalSampler: global batch size must be positive, got ", global_batch);
  TORCH_CHECK(dataset_size >= 0, "GlobalSampler: dataset size must be >= 0, got ", dataset_size);
}

int64_t GlobalSampler::steps_per_epoch() const {
  return drop_last_ ? size_ / batch_ : (size_ + batch_ - 1) / batch_;
}

int64_t GlobalSampler::batch_samples(int64_t step_in_epoch) const {
  TORCH_INTERNAL_ASSERT(step_in_epoch >= 0 && step_in_epoch < steps_per_epoch());
  return std::min(batch_, size_ - step_in_epoch * batch_);
}

std::vector<int64_t> GlobalSampler::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(size_));
  for (int64_t i = 0; i < size_; ++i) order[size_t(i)] = i;
  if (!shuffle_) return order;
  // One stream per (seed, epoch). mt19937_64's output is fixed by the standard; the
  // reduction to [0, i] is ours (std::uniform_int_distribution and std::shuffle are
  // implementation-defined), rejection-sampled so that it is unbiased.
  std::seed_seq seq{uint32_t(seed_), uint32_t(seed_ >> 32), uint32_t(epoch), uint32_t(uint64_t(epoch) >> 32)};
  std::mt19937_64 rng(seq);
  for (int64_t i = size_ - 1; i > 0; --i) {
    const uint64_t range = uint64_t(i) + 1;
    const uint64_t limit = UINT64_MAX - UINT64_MAX % range;
    uint64_t x;
    do x = rng();
    while (x >= limit);
    std::swap(order[size_t(i)], order[size_t(x % range)]);
  }
  return order;
}

std::vector<int64_t> GlobalSampler::batch_indices(int64_t epoch, int64_t step_in_epoch) {
  if (epoch != cached_epoch_) {
    cached_order_ = epoch_order(epoch);
    cached_epoch_ = epoch;
  }
  const int64_t begin = step_in_epoch * batch_, n = batch_samples(step_in_epoch);
  return {cached_order_.begin() + begin, cached_order_.begin() + begin + n};
}

}  // namespace fsdp::trainer
