// Reduce-scatter's local sum over raw buffers: N rows of one chunk into the output.
//
// Torch-free on purpose (built with the other kernels, -O3, no PCH); src/comm/collectives.cpp
// owns dtypes, views and the fallback to ATen ops.
#pragma once

#include <cstdint>

namespace fsdp {
namespace comm {
namespace kernels {

/// out[i] = (...((rows[0][i] + rows[1][i]) + rows[2][i]) + ...) + rows[nrows-1][i] for
/// i < len: the rows added in order, each addition rounded on its own (no reassociation,
/// no fused multiply-add), so the result equals at::add_out(out, r0, r1) followed by
/// out.add_(r2), ..., bit for bit. It walks the rows block by block so that the output
/// block stays in cache while every row is added to it: memory sees nrows reads and one
/// write, where the ATen sequence makes nrows-1 passes over the output.
/// nrows >= 2; `out` must not overlap any row. With threads > 1 and a long row, blocks
/// are shared among that many OpenMP threads.
void sum_rows(float* out, const float* const* rows, int nrows, int64_t len, int threads);
void sum_rows(double* out, const double* const* rows, int nrows, int64_t len, int threads);

}  // namespace kernels
}  // namespace comm
}  // namespace fsdp
