#pragma once
// Internal to fsdp (core and optim): the one device a wrapped model's parameters live on, checked
// against the rank's process group before any unit or group is made.
//
// [Note: device placement]
// FSDP and ZeRO run where the parameters are: the user moves the model to the rank's
// GPU (ProcessGroup::cuda_device()) before wrapping it, as with PyTorch FSDP's module on
// its device. Flat parameters, gradients and pool blocks are then made on that device
// (BufferPool asks the device's own allocator), and the runtime orders its all-gather and
// reduce-scatter streams with the CUDA stream order ([Note: stream order]). One device
// per model: a model spread over devices, a GPU other than the rank's, or a GPU on a
// group that cannot move CUDA tensors fails here, naming the parameter and the fix.
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp::comm {
class ProcessGroup;
}  // namespace fsdp::comm

namespace fsdp::comm::detail {

/// The device of every tensor in `params` (name as messages show it, tensor); CPU when
/// there are none.
/// `who` opens the messages ("fsdp", "ZeroRedundancyOptimizer").
at::Device model_device(const std::vector<std::pair<std::string, at::Tensor>>& params,
                        const ProcessGroup& pg, const char* who);

}  // namespace fsdp::comm::detail
