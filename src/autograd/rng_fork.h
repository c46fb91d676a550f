#pragma once
// The random number generator states a recompute must replay: the CPU default generator's
// and the default generator of every CUDA device the checkpoint's inputs live on. Captured
// before the first forward and installed around the recompute, then the states from before
// the recompute are put back, so dropout recomputes bit for bit and the stream after
// backward is the one a run without the checkpoint leaves.
#include <vector>

#include <ATen/ATen.h>

namespace fsdp::autograd::detail {

class RngStates {
 public:
  /// The states now of the CPU generator and of the CUDA devices `inputs` live on.
  static RngStates capture(const std::vector<at::Tensor>& inputs);
  /// Installs these states; returns the ones it replaced.
  RngStates install() const;

 private:
  struct One {
    at::Generator generator;
    at::Tensor state;
  };
  std::vector<One> states_;
};

/// Installs `states` for its lifetime, then puts back the states it replaced.
class RngFork {
 public:
  explicit RngFork(const RngStates& states) : replaced_(states.install()) {}
  ~RngFork() { replaced_.install(); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStates replaced_;
};

}  // namespace fsdp::autograd::detail
