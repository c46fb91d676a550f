#pragma once
// Internal to src/comm: all-gather and reduce-scatter over Gloo send/recv, in segments
// (see [Note: point-to-point all-gather and reduce-scatter] in gloo_p2p.cpp). The
// default algorithm of GlooTransport.
#include <ATen/core/Tensor.h>

#include "comm/transport.h"

namespace fsdp::comm::detail {

class GlooTransport;

/// Transport::all_gather's contract, over send/recv.
Issued p2p_all_gather(GlooTransport& t, const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard);
/// Transport::reduce_scatter's contract, over send/recv.
Issued p2p_reduce_scatter(GlooTransport& t, const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat,
                          ReduceOp op);

}  // namespace fsdp::comm::detail
