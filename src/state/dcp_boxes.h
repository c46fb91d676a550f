#pragma once
// Internal to src/state: between a flat range of a tensor's elements (what a rank's shard
// holds: [begin, end) of the flattened parameter) and the boxes a DCP checkpoint stores
// (offsets and sizes per dimension: FSDP2 saves each rank's dim-0 chunk as one box). Without
// torch.
//
// [Note: boxes of a flat range]
// A flat range that starts or ends inside a row is no box; it is the union of boxes that are
// each consecutive in flat order: the tail of its first row (recursively, that row's own
// partial sub-rows), the whole rows between, the head of its last row. For a 2-D tensor that
// is at most three boxes; in general at most 2 x (dims - 1) + 1. Reading goes the other way:
// a box is a set of runs of consecutive flat elements, one per index of its leading
// dimensions, merged where the trailing dimensions are whole; a box FSDP2 wrote (whole rows)
// is one run.

#include <cstdint>
#include <vector>

#include "dcp_metadata.h"

namespace fsdp::state::dcp {

/// Boxes, each consecutive in flat order, whose union is elements [begin, end) of a tensor of
/// `shape`, in flat order. A 0-dimensional tensor's one element is the box of no dimensions.
std::vector<Chunk> boxes_of(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

/// `length` consecutive elements: flat index `flat` of the tensor, index `local` of the box's
/// own row-major elements.
struct Run {
  int64_t flat = 0, local = 0, length = 0;
};
/// The box's elements as runs, in flat order.
std::vector<Run> runs_of(const std::vector<int64_t>& shape, const Chunk& box);

/// Elements of a tensor of `shape` (1 for no dimensions).
int64_t numel_of(const std::vector<int64_t>& shape);

}  // namespace fsdp::state::dcp
