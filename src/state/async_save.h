#pragma once
// Internal to src/state: one asynchronous save (fsdp/state/async_checkpoint.h) and this
// process's save in flight.
//
// [Note: asynchronous saves]
// A save is a small state machine, advanced by two threads:
//
//   kWriting --writer: file durable, ranks agreed--> kWritten --training thread--> kPublished
//       \--writer: any rank failed--> kFailed <--training thread: rank 0's rename failed--/
//
// The writer thread runs write_checkpoint (checkpoint_writer.h) with Publication::kLater:
// it needs nothing from the training thread, and the training thread nothing from it, so
// neither waits for the other. Rank 0 renames `<dir>.tmp` into place on its training thread
// (poll() or wait()), at a step boundary, so a checkpoint appears only between steps, when
// the trainer and the user look for it. The other ranks have nothing to publish: for them
// kWritten moves to kPublished at the next poll().
// One save at a time: a second would write the same rank files' names in another `.tmp`
// and double the snapshot memory; the next save first settles the one in flight.

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "checkpoint_subject.h"
#include "fsdp/state/async_checkpoint.h"
#include "save_plan.h"
#include "store_agreement.h"

namespace fsdp::state::detail {

class AsyncSave {
 public:
  /// Starts the writer thread on `plan` (whose records training no longer writes).
  AsyncSave(SavePlan plan, StoreAgreement agree, CheckpointSaveStats stats);
  ~AsyncSave();
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  /// Training thread. Whether the save is over (published or failed); publishes a written one.
  bool poll();
  /// Training thread. Blocks until the save is over, publishes it; throws its error.
  void wait();
  /// Training thread. As wait(), but throws only an error no wait() has raised yet.
  void settle();
  std::string error() const;
  CheckpointSaveStats stats() const;
  void add_blocked(double seconds);

 private:
  enum class Stage { kWriting, kWritten, kPublished, kFailed };

  void write();  // the writer thread
  void advance_after_writer();  // training thread, the writer joined
  void raise();

  SavePlan plan_;
  StoreAgreement agree_;
  mutable std::mutex mu_;
  Stage stage_ = Stage::kWriting;
  std::string error_;
  bool raised_ = false;
  CheckpointSaveStats stats_;
  std::thread writer_;
};

/// save_checkpoint_async of any subject ([Note: checkpoint subjects]).
CheckpointHandle save_async_of(const std::string& dir, const CheckpointSubject& subject,
                               const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra,
                               const AsyncCheckpointOptions& options);

/// prepare_async_checkpoint of any subject: the records a save would protect, moved onto
/// pages of their own.
int64_t prepare_of(const CheckpointSubject& subject, const torch::optim::Optimizer* optimizer);

/// Settles this process's save in flight, if any (AsyncSave::settle). Every save and load
/// calls it first.
void settle_in_flight();

}  // namespace fsdp::state::detail
