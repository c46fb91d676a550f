#pragma once
/// `--estimate-memory`: model-state bytes per rank with fp32 Adam, by strategy (ZeRO paper
/// §5, Ψ parameters, N ranks; 4 bytes each of parameter and gradient, 8 of Adam state):
///   NO_SHARD 16Ψ   SHARD_GRAD_OP 4Ψ + 12Ψ/N   FULL_SHARD 16Ψ/N
/// Activations, transient unsharded buffers and flat-buffer padding are not included.
/// The parameter counts are arithmetic (models.h builds exactly these); the bytes come from
/// the library function fsdp::estimate_model_state.

#include <cstdint>
#include <cstdio>

#include "fsdp/trainer/memory_summary.h"
#include "options.h"

namespace fsdp::train {

/// Linear(784,H), Linear(H,H), Linear(H,10), with biases.
int64_t mlp_num_params(int64_t hidden);
/// Conv2d(1,16,3), Conv2d(16,32,3), Linear(32*7*7,10), with biases.
int64_t cnn_num_params();
/// Token and position embeddings, `layers` blocks of 12*dim^2 + 13*dim, final LayerNorm,
/// bias-free head: (256 + context + 2)*dim + layers*(12*dim^2 + 13*dim) + 256*dim.
int64_t gpt_num_params(int64_t layers, int64_t dim, int64_t context);
/// The parameter count of the model `o` selects.
int64_t model_num_params(const TrainOptions& o);

/// Parameters of one gpt block: 12*dim^2 + 13*dim.
int64_t gpt_block_num_params(int64_t dim);

/// `bf16` (--mixed-precision bf16): the ZERO1 / ZERO2 rows with bf16 parameters.
void print_memory_estimate(std::FILE* out, int64_t num_params, int world_size, bool bf16);

/// The construction peak per rank for the run `o` describes (its model, --strategy,
/// --eager-init), from fsdp::estimate_construction, and the training peak's predictable part
/// (model state + units gathered at a time); what fsdp-train's summary measures as
/// "build peak" and "train peak".
void print_construction_estimate(std::FILE* out, const TrainOptions& o, int world_size);

/// "1.23 MiB" style (the library's, shared with the Trainer's memory summary).
using fsdp::trainer::format_bytes;

}  // namespace fsdp::train
