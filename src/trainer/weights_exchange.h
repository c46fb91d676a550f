#pragma once
// Internal to src/trainer: the weights a run starts from and the weights it hands on, as
// safetensors (TrainerOptions::init_from, export_safetensors; fsdp/state/safetensors.h).
// Both collective; an error on any rank fails every rank with its words.
#include "loop_context.h"

namespace fsdp::trainer::detail {

/// A fresh run: loads TrainerOptions::init_from into the model (FSDP: each rank its shards;
/// ZeRO: every rank the whole replica).
void load_initial_weights(const LoopContext& ctx);

/// After the last step: writes the weights to TrainerOptions::export_safetensors (FSDP:
/// gathered unit by unit, written by rank 0; ZeRO: rank 0's replica).
void export_weights(const LoopContext& ctx);

}  // namespace fsdp::trainer::detail
