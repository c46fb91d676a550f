#pragma once
// Tensors that are views of a mapped state dict file (map_full_state_dict in
// include/fsdp/state/rank0_load.h): what the rank-0 load needs to hand their
// pages back once it has copied them.

#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp::state::detail {

/// For each file mapped by map_full_state_dict that one of `tensors` views,
/// drops all of its pages from this process (madvise MADV_DONTNEED: a later read
/// maps them from the file again; copy-on-write changes are lost). Tensors that
/// are not such views are ignored.
void release_mapped_pages(const std::vector<at::Tensor>& tensors);

}  // namespace fsdp::state::detail
