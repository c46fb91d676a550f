#pragma once
// Internal to src/comm: all-gather and reduce-scatter of small flat buffers through one
// Gloo alltoall (see [Note: small buffers over Gloo's alltoall] in gloo_alltoall.cpp).
// GlooTransport picks it at N >= 3 for flat buffers of at most comm_alltoall_max_bytes().
#include <ATen/core/Tensor.h>

#include "comm/transport.h"

namespace fsdp::comm::detail {

class GlooTransport;

/// Transport::all_gather's contract, over one alltoall.
Issued alltoall_all_gather(GlooTransport& t, const GroupDesc& g, const at::Tensor& flat,
                           const at::Tensor& shard);
/// Transport::reduce_scatter's contract, over one alltoall.
Issued alltoall_reduce_scatter(GlooTransport& t, const GroupDesc& g, const at::Tensor& out,
                               const at::Tensor& flat, ReduceOp op);

}  // namespace fsdp::comm::detail
