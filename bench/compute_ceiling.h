// The compute ceiling of a training step and the pieces of its attainable bound,
// measured by bench_strategies on every rank in the same process and run as the
// step it is compared with (docs/benchmarks.md, "Steps against the compute ceiling").
//
// A step cannot be faster than this rank's plain libtorch forward + backward of its
// slice of the batch (the ceiling), measured with every rank running it at the same
// time: the two cores share caches, memory bandwidth and clocks as in training, and
// that costs ~1.5x over one rank alone. Added to it, the work a strategy cannot avoid:
// its optimizer over the parameters this rank owns, and one copy of every byte its
// collectives move (comm_counters) at the memcpy bandwidth measured here, also with
// every rank copying at once. Each probe times `steps` repetitions between two
// barriers and reports the slowest rank's mean (ms), like the step itself.
// Header-only: benchmarks link the library, not each other.
#pragma once

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/host_memory.h"
#include "fsdp/optim/cpu_adam.h"

namespace fsdp {
namespace bench {

/// Mean ms per repetition of `body` over `reps`, the slowest rank's, every rank
/// starting together after a barrier.
inline double timed_together_ms(const comm::ProcessGroup& pg, int reps, const std::function<void()>& body) {
  comm::barrier(pg);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) body();
  auto el = torch::tensor({std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()},
                          torch::kDouble);
  comm::all_reduce(pg, el, comm::ReduceOp::kMax).wait();
  return el.item<double>() * 1e3 / reps;
}

/// Plain libtorch forward + backward of `model` (unwrapped, its own copy) on this
/// rank's (x, y): gradients zeroed in place, malloc keeping freed blocks as the
/// library does ([Note: freed host memory]); no optimizer, no communication.
class PlainComputeProbe {
 public:
  PlainComputeProbe(torch::nn::Sequential model, at::Tensor x, at::Tensor y)
      : model_(std::move(model)), x_(std::move(x)), y_(std::move(y)) {
    keep_freed_host_memory();
    step();  // gradients exist from here on and are zeroed in place
  }
  void step() {
    for (auto& p : model_->parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
    torch::nn::functional::cross_entropy(model_->forward(x_), y_).backward();
  }
  double ms(const comm::ProcessGroup& pg, int steps) {
    return timed_together_ms(pg, steps, [this] { step(); });
  }

 private:
  torch::nn::Sequential model_;
  at::Tensor x_, y_;
};

/// One optimizer step over `numel` fp32 parameters (one tensor, as a flat shard is),
/// with CPUAdam ("cpuadam") or torch::optim::Adam ("adam"), lr 1e-3.
inline double optimizer_step_ms(const comm::ProcessGroup& pg, const std::string& optim, int64_t numel, int steps) {
  if (numel <= 0) return 0;
  auto p = torch::randn({numel}).requires_grad_(true);
  p.mutable_grad() = torch::randn({numel});
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (optim == "cpuadam") opt = std::make_unique<optim::CPUAdam>(std::vector<at::Tensor>{p}, optim::CPUAdamOptions(1e-3));
  else opt = std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{p}, torch::optim::AdamOptions(1e-3));
  opt->step();  // state allocated outside the timing
  return timed_together_ms(pg, steps, [&] { opt->step(); });
}

/// memcpy bandwidth (bytes/s) with every rank copying `block_bytes` blocks at once,
/// between pre-faulted buffers; `total_bytes` copied per rank.
inline double memcpy_bytes_per_s(const comm::ProcessGroup& pg, int64_t block_bytes, int64_t total_bytes) {
  std::vector<char> src(static_cast<size_t>(block_bytes), 1), dst(static_cast<size_t>(block_bytes), 0);
  const int reps = static_cast<int>(std::max<int64_t>(1, total_bytes / block_bytes));
  std::memcpy(dst.data(), src.data(), src.size());
  const double ms = timed_together_ms(pg, reps, [&] {
    std::memcpy(dst.data(), src.data(), src.size());
    src[0] = dst[1];  // the copies depend on each other: none can be dropped
  });
  return block_bytes / (ms * 1e-3);
}

/// memcpy bandwidth (bytes/s) of `block_bytes` blocks that are not in any cache: before
/// each copy, this rank walks `evict_bytes` of other memory (not timed), as a step's
/// working set (unsharded parameters, gradients, optimizer state: tens of MB per rank)
/// evicts a shard between its uses. Every rank copies at once; the slowest rank's
/// total copy time counts. A second figure beside memcpy_bytes_per_s, for reading the
/// bound, not part of it.
inline double memcpy_uncached_bytes_per_s(const comm::ProcessGroup& pg, int64_t block_bytes, int64_t evict_bytes,
                                          int reps) {
  std::vector<char> src(static_cast<size_t>(block_bytes), 1), dst(static_cast<size_t>(block_bytes), 0);
  std::vector<char> other(static_cast<size_t>(evict_bytes), 2);
  double seconds = 0;
  comm::barrier(pg);
  for (int i = 0; i < reps; ++i) {
    for (size_t j = 0; j < other.size(); j += 64) other[j] = static_cast<char>(other[j] + 1);
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), src.size());
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    src[static_cast<size_t>(i)] = dst[static_cast<size_t>(i) + 1];  // the copies depend on each other
  }
  auto el = torch::tensor({seconds}, torch::kDouble);
  comm::all_reduce(pg, el, comm::ReduceOp::kMax).wait();
  return block_bytes * static_cast<double>(reps) / el.item<double>();
}

}  // namespace bench
}  // namespace fsdp
