#pragma once
// Internal to src/state: the tensors of a model a load from a foreign format fills
// (safetensors, DCP): each parameter's piece on this rank and each buffer, as flat
// destinations of the model's dtype on the model's device.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "core/state_view.h"

namespace fsdp::state {

/// One tensor of the model a load fills: a parameter (under its first name; a tied one's
/// other names in `aliases`) or a buffer.
struct LoadTarget {
  std::string name;
  std::vector<std::string> aliases;
  std::vector<int64_t> shape;  // full shape
  /// This rank's elements [begin, end) of the flattened value, as a contiguous tensor of the
  /// model's dtype on the model's device.
  at::Tensor dest;
  int64_t begin = 0, end = 0;
  at::Tensor param;  // the registered parameter (undefined for a buffer): the optimizer's key
};

class LoadTargets {
 public:
  /// A sharded model: each parameter's piece on this rank (local_pieces), then the buffers.
  LoadTargets(const std::vector<core::detail::LocalPiece>& pieces, torch::nn::Module& m);
  /// An unsharded module: each parameter whole (a tied one once, its other names as
  /// aliases), then the buffers.
  explicit LoadTargets(torch::nn::Module& m);

  const std::vector<LoadTarget>& list() const { return list_; }
  /// Copies what was loaded into stand-ins back (a buffer that is not contiguous is loaded
  /// into a contiguous copy). Call once every destination is filled.
  void finish() const;

 private:
  struct CopyBack {
    at::Tensor from, to;
  };
  std::vector<LoadTarget> list_;
  std::vector<CopyBack> copy_back_;

  LoadTarget whole(const std::string& name, const at::Tensor& value);
  void add_buffers(torch::nn::Module& m);
};

}  // namespace fsdp::state
