#pragma once
/// Asynchronous checkpoints: the save returns at once and a writer thread writes while
/// training goes on.
///
///     fsdp::CheckpointHandle h = fsdp::save_checkpoint_async("ckpt/step-100", *model, &optimizer, extra);
///     for (...) {  // training goes on while the writer writes
///       loss_fn(model->forward(x)).backward();
///       optimizer.step();
///       if (h.done()) break;  // written; rank 0 has renamed it into place in done()
///     }
///     h.wait();  // before exiting, or the next save
///
/// What is written is exactly what save_checkpoint would write at the call (same files,
/// same bytes): the call snapshots this rank's records and returns; the writer thread
/// writes and fsyncs them, and the ranks agree through the group's store, never through a
/// collective on the training's groups ([Note: checkpoint agreement through the store] in
/// src/state/store_agreement.h). Rank 0 renames the finished directory into place at a
/// later step boundary of its own: in done() or wait(). Until then the previous checkpoint
/// at `dir` is untouched, and a crash leaves it so.
///
/// At most one save is in flight per process: the next save (asynchronous or not), a load,
/// and wait_for_checkpoints() first wait for it (AsyncCheckpointOptions::skip_if_busy skips
/// the new one instead). A failed save is raised by wait(), on every rank, naming the rank
/// that failed and why; one nobody waited for is raised by the next save or
/// wait_for_checkpoints(). Wait for the last save before the process exits.

#include <cstdint>
#include <memory>
#include <string>

#include <torch/arg.h>

#include "fsdp/state/checkpoint.h"

namespace fsdp {

namespace state::detail {
class AsyncSave;
}

struct AsyncCheckpointOptions {
  /// When this process's previous asynchronous save is still being written: false waits
  /// for it (counted in blocked time); true skips this save on every rank (one all-reduce
  /// of a flag, so all ranks skip together) and counts it (skipped_checkpoints()).
  TORCH_ARG(bool, skip_if_busy) = false;
  /// The most host memory a snapshot may hold, in bytes: the records it copies whole and
  /// the pages training writes before the writer has taken them (copy-on-write). A save
  /// whose whole copies alone exceed it is written while the caller waits, as by
  /// save_checkpoint, with a warning; past it, a page training writes waits for the writer.
  /// 0 means a quarter of the host's memory divided among the ranks on this host.
  TORCH_ARG(int64_t, host_snapshot_bytes) = 0;
};

/// What one save cost, on this rank.
struct CheckpointSaveStats {
  double blocked_s = 0;          ///< the training thread inside the save call, all of it
  double waited_previous_s = 0;  ///< of blocked_s: waiting for the previous save
  double snapshot_s = 0;         ///< of blocked_s: taking the snapshot
  double background_s = 0;       ///< the writer: start to this rank's file durable and agreed
  int64_t file_bytes = 0;        ///< this rank's file
  int64_t direct_bytes = 0;      ///< of file_bytes: written to the disk straight from memory (O_DIRECT)
  int64_t snapshot_bytes = 0;    ///< records the snapshot copied whole (device, shared memory, buffers)
  int64_t cow_bytes = 0;         ///< bytes the snapshot protected copy-on-write instead
  int64_t cow_pages_copied = 0;  ///< of those, pages training wrote before the writer took them
  double cow_fault_s = 0;        ///< training threads' time copying those pages (not in blocked_s)
  double cow_wait_s = 0;         ///< of cow_fault_s: waiting for the writer (its chunk in hand, or room)
  double cow_protect_s = 0;      ///< of snapshot_s: protecting the pages
  bool skipped = false;          ///< skip_if_busy skipped it
  bool blocking = false;         ///< over host_snapshot_bytes: written while the caller waited
};

/// One asynchronous save. Cheap to copy (shared state).
class CheckpointHandle {
 public:
  CheckpointHandle() = default;
  explicit CheckpointHandle(std::shared_ptr<state::detail::AsyncSave> save) : save_(std::move(save)) {}

  bool valid() const { return save_ != nullptr; }
  /// Whether the save has finished, written or failed. Never blocks; on rank 0 a written
  /// save is renamed into place in this call.
  bool done();
  /// Blocks until the save has finished; then throws its error, if any, on every rank.
  void wait();
  /// The save's error ("" while it runs or when it succeeded).
  std::string error() const;
  CheckpointSaveStats stats() const;

 private:
  std::shared_ptr<state::detail::AsyncSave> save_;
};

/// save_checkpoint (fsdp/state/checkpoint.h), asynchronously: returns once this rank's
/// snapshot is taken. Collective over the model's process group (every rank calls it at
/// the same step); call it between steps.
CheckpointHandle save_checkpoint_async(const std::string& dir, FullyShardedBase& model,
                                       const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra = {},
                                       const AsyncCheckpointOptions& options = {});

/// Takes the first asynchronous save's one-time copy ahead of it: moves the state a save
/// protects copy-on-write (parameter shards and optimizer state in plain host memory) onto
/// pages of its own ([Note: state on pages of its own] in src/memory/own_pages.h), so that
/// no save's call pays for it. Call it after the first optimizer step (optimizers create
/// their state there) and before the first save; the Trainer does when it saves
/// asynchronously. Not collective. Returns the bytes on pages of their own.
int64_t prepare_async_checkpoint(FullyShardedBase& model, const torch::optim::Optimizer* optimizer);

/// Waits for this process's save in flight, if any, publishing it; throws its error if
/// nobody has waited for it yet.
void wait_for_checkpoints();

/// Saves skip_if_busy skipped in this process.
int64_t skipped_checkpoints();

}  // namespace fsdp
