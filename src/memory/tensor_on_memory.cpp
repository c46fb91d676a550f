#include "tensor_on_memory.h"

#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

namespace fsdp::memory {

at::Tensor tensor_on_memory(at::DataPtr memory, at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(memory), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, sizes, c10::contiguous_strides(sizes));
}

}  // namespace fsdp::memory
