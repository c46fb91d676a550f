#pragma once
// Internal to src/trainer: the training loop's own part of a checkpoint.
//
// [Note: trainer checkpoint state]
// Besides the model and the optimizer (fsdp::save_checkpoint's), a checkpoint holds:
//  * trainer.step: optimizer steps done. The data position: step s's samples are a
//    pure function of (seed, epoch, step in epoch) ([Note: global batches]), so the
//    step is all the sampler needs.
//  * the values that fix the data order (seed, global batch size, dataset size,
//    shuffle, last batch policy): a resumed run with other values is refused naming
//    the value, rather than continuing on other data.
//  * trainer.world_size and one torch CPU generator state per rank
//    (trainer.rng.rank<r>): at the same world size each rank continues its own
//    stream; at another, every rank takes rank 0's.
//  * whatever callbacks add in on_save_checkpoint.
#include <cstdint>
#include <map>
#include <string>

#include "fsdp/comm/process_group.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/trainer/trainer_options.h"

namespace fsdp::trainer::detail {

/// The loop's extras for a checkpoint of the state after `step` steps of a run with
/// options `o` over `train_size` samples. Collective: gathers every rank's generator.
CheckpointExtra trainer_state(const TrainerOptions& o, int64_t train_size, const comm::ProcessGroup& pg,
                              int64_t step);

/// "" if `saved` (a checkpoint's extra values) continues the run `o` describes over
/// `train_size` samples; otherwise why not, naming checkpoint `dir` and the fix.
std::string trainer_state_mismatch(const TrainerOptions& o, int64_t train_size, const std::string& dir,
                                   const std::map<std::string, std::string>& saved);

/// The steps done when the checkpoint was saved (its extras passed
/// trainer_state_mismatch).
int64_t saved_step(const CheckpointExtra& extra);

/// This rank's torch CPU generator from the checkpoint: its own at the same world size,
/// rank 0's at another.
void restore_generator(const CheckpointExtra& extra, const comm::ProcessGroup& pg);

}  // namespace fsdp::trainer::detail
