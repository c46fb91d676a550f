#pragma once
// Internal to src/comm: a temporary that one stream allocated and another stream uses.
//
// The caching allocator knows the stream a block was allocated on and reuses the block in
// that stream's order once the tensor is freed. A collective's temporary (the fp32 copy of a
// bf16 all-reduce, a reduce-scatter's own output) is allocated on the issuing stream but read
// on the waiting one when the handle finishes; freed right after, its block could be handed
// to the next allocation on the issuing stream while the waiting stream's read is still
// queued. Telling the allocator about the waiting stream keeps the block until that read is
// done, as Tensor.record_stream does in Python.
#include <ATen/core/Tensor.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace fsdp::comm::detail {

/// `t`'s memory is reused only after the work queued so far on its device's current stream;
/// nothing for host tensors.
inline void used_on_current_stream(const at::Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return;
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), impl.getStream(t.device()));
}

}  // namespace fsdp::comm::detail
