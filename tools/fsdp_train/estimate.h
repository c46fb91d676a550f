#pragma once
/// `--estimate-memory`: model-state bytes per rank with fp32 Adam, by strategy (ZeRO paper
/// §5, Ψ parameters, N ranks; 4 bytes each of parameter and gradient, 8 of Adam state):
///   NO_SHARD 16Ψ   SHARD_GRAD_OP 4Ψ + 12Ψ/N   FULL_SHARD 16Ψ/N
/// Activations, transient unsharded buffers and flat-buffer padding are not included.
/// Torch-free: the mlp's parameter count is arithmetic.

#include <cstdint>
#include <cstdio>

namespace fsdp::train {

/// Linear(784,H), Linear(H,H), Linear(H,10), with biases.
int64_t mlp_num_params(int64_t hidden);

void print_memory_estimate(std::FILE* out, int64_t num_params, int world_size);

/// "1.23 MiB" style.
void format_bytes(double bytes, char* out, size_t size);

}  // namespace fsdp::train
