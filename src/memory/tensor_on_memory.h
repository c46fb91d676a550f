#pragma once
// Internal to src: a tensor over memory that someone other than the tensor's allocator
// handed out.
//
// The buffer pool's blocks, the buffers collectives read in place (the exchange arena's
// blocks, comm::allocate_collective_buffer) and storage placeholders all arrive as a
// DataPtr. The tensor takes it as its storage, sized to the tensor's bytes and not
// resizable, so nothing reallocates the memory behind whoever handed it out, and freeing
// the tensor's last reference runs the DataPtr's own deleter (a pool lease goes back to
// its pool).
#include <ATen/ATen.h>

namespace fsdp::memory {

/// A contiguous tensor of `sizes` and `options` whose storage is `memory`, which holds at
/// least the tensor's bytes. Its contents are what the memory holds. A null `memory`
/// makes a placeholder: a storage of the right size with no memory behind it (what a
/// pickler needs to describe a tensor without holding it).
at::Tensor tensor_on_memory(at::DataPtr memory, at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace fsdp::memory
