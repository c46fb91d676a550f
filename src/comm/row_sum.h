#pragma once
// Internal to src/comm: the rank-order sum that makes reduce-scatter and all-reduce
// deterministic on every transport (Gloo send/recv, Gloo alltoall, shared memory).
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp::comm::detail {

/// acc = rows[0] + rows[1] + ... in this order, each addition rounded on its own. fp32 and
/// fp64 go through one blocked pass (kernels/row_sum_kernel.h, same bits as the ATen
/// sequence, which reads and writes `acc` once per row); other dtypes use that sequence.
/// At least two rows, all of acc's dtype and length; `acc` must not overlap the rows.
void sum_rows_into(at::Tensor acc, const std::vector<at::Tensor>& rows);

}  // namespace fsdp::comm::detail
