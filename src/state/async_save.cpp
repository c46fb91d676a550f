// See [Note: asynchronous saves] in async_save.h.
#include "async_save.h"

#include <chrono>
#include <cstdio>

#include <unistd.h>

#include <torch/torch.h>

#include "checkpoint_span.h"
#include "checkpoint_writer.h"
#include "error_message.h"
#include "fsdp/comm/call_label.h"
#include "fsdp/comm/collectives.h"

namespace fsdp {

namespace state::detail {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::mutex& slot_mutex() {
  static std::mutex mu;
  return mu;
}

std::shared_ptr<AsyncSave>& in_flight() {
  static std::shared_ptr<AsyncSave> save;
  return save;
}

std::atomic<int64_t>& skipped() {
  static std::atomic<int64_t> count{0};
  return count;
}

int64_t snapshot_cap(const AsyncCheckpointOptions& options, const comm::ProcessGroup& pg) {
  if (options.host_snapshot_bytes() > 0) return options.host_snapshot_bytes();
  const int64_t host = int64_t(::sysconf(_SC_PHYS_PAGES)) * int64_t(::sysconf(_SC_PAGESIZE));
  return host / 4 / std::max(1, pg.local_world_size());
}

// skip_if_busy: whether any rank's previous save is still being written (then all skip).
bool previous_still_running(const comm::ProcessGroup& pg) {
  std::shared_ptr<AsyncSave> previous;
  {
    std::lock_guard<std::mutex> lock(slot_mutex());
    previous = in_flight();
  }
  auto busy = torch::full({1}, previous && !previous->poll() ? 1 : 0, torch::kLong);
  if (pg.size() > 1) {
    comm::LabelScope label_scope({comm::Phase::kCheckpoint, "save (is one in flight?)"});
    comm::all_reduce(pg, busy, comm::ReduceOp::kMax).wait();
  }
  return busy.item<int64_t>() != 0;
}

// The plan and its snapshot (the training thread's part of a save). A failure here is the
// plan's error, which the writer reports like a failed write, so no rank waits for this one.
SavePlan plan_and_snapshot(const std::string& dir, const CheckpointSubject& subject,
                           const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra, int64_t cap,
                           CheckpointSaveStats& stats) {
  SavePlan plan = plan_save(dir, subject, optimizer, extra);
  if (!plan.error.empty()) return plan;
  const auto t0 = Clock::now();
  try {
    const SnapshotTaken taken = snapshot(plan, cap);
    stats.snapshot_bytes = taken.copied_bytes;
    stats.cow_bytes = taken.cow_bytes;
    if (!taken.fits) {
      stats.blocking = true;
      std::fprintf(stderr,
                   "fsdp: warning: save_checkpoint_async on rank %d: the records it must copy (%lld bytes) exceed "
                   "host_snapshot_bytes (%lld), so '%s' is written while training waits; raise the cap to save "
                   "asynchronously\n",
                   subject.group.rank(), static_cast<long long>(taken.copied_bytes), static_cast<long long>(cap),
                   dir.c_str());
    }
  } catch (const std::exception& e) {
    plan.records.clear();
    plan.cow.reset();
    plan.error = std::string("taking the snapshot failed: ") + error_message(e);
  }
  stats.snapshot_s = seconds_since(t0);
  return plan;
}

}  // namespace

AsyncSave::AsyncSave(SavePlan plan, StoreAgreement agree, CheckpointSaveStats stats)
    : plan_(std::move(plan)), agree_(std::move(agree)), stats_(stats) {
  writer_ = std::thread([this] { write(); });
}

AsyncSave::~AsyncSave() {
  if (writer_.joinable()) writer_.join();
}

void AsyncSave::write() {
  const auto t0 = Clock::now();
  std::string error;
  WrittenSave written;
  try {
    CheckpointSpan span(plan_.tracer, "checkpoint write " + plan_.dir, Tracer::kCheckpoint);
    written = write_checkpoint(plan_, agree_, Publication::kLater);
  } catch (const std::exception& e) {
    error = error_message(e);
  }
  CheckpointSaveStats cow;
  if (plan_.cow) {
    plan_.cow->release();  // (write_checkpoint did, unless it failed first)
    const memory::CowStats c = plan_.cow->stats();
    cow.cow_pages_copied = c.pages_copied;
    cow.cow_fault_s = double(c.fault_ns) * 1e-9;
    cow.cow_wait_s = double(c.wait_ns) * 1e-9;
    cow.cow_protect_s = double(c.protect_ns) * 1e-9;
  }
  plan_.records.clear();  // the snapshot's memory
  plan_.cow.reset();
  std::lock_guard<std::mutex> lock(mu_);
  stats_.cow_pages_copied = cow.cow_pages_copied;
  stats_.cow_fault_s = cow.cow_fault_s;
  stats_.cow_wait_s = cow.cow_wait_s;
  stats_.cow_protect_s = cow.cow_protect_s;
  stats_.background_s = seconds_since(t0);
  stats_.file_bytes = written.file_bytes;
  stats_.direct_bytes = written.direct_bytes;
  error_ = error;
  stage_ = error.empty() ? Stage::kWritten : Stage::kFailed;
}

void AsyncSave::advance_after_writer() {
  if (writer_.joinable()) writer_.join();
  std::lock_guard<std::mutex> lock(mu_);
  if (stage_ != Stage::kWritten) return;
  if (agree_.rank() == 0) {
    try {
      publish(plan_.tmp, plan_.dir);
    } catch (const std::exception& e) {
      error_ = std::string("fsdp: save_checkpoint_async (rank 0, renaming '") + plan_.tmp + "' into place): " +
               error_message(e);
      stage_ = Stage::kFailed;
      return;
    }
  }
  stage_ = Stage::kPublished;
}

bool AsyncSave::poll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stage_ == Stage::kWriting) return false;
  }
  advance_after_writer();
  return true;
}

void AsyncSave::raise() {
  std::lock_guard<std::mutex> lock(mu_);
  if (stage_ != Stage::kFailed) return;
  raised_ = true;
  TORCH_CHECK(false, error_);
}

void AsyncSave::wait() {
  advance_after_writer();
  raise();
}

void AsyncSave::settle() {
  advance_after_writer();
  bool raised;
  {
    std::lock_guard<std::mutex> lock(mu_);
    raised = raised_;
  }
  if (!raised) raise();
}

std::string AsyncSave::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

CheckpointSaveStats AsyncSave::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void AsyncSave::add_blocked(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.blocked_s += seconds;
}

int64_t prepare_of(const CheckpointSubject& subject, const torch::optim::Optimizer* optimizer) {
  const SavePlan plan = plan_save("(prepare_async_checkpoint)", subject, optimizer, CheckpointExtra{});
  TORCH_CHECK(plan.error.empty(), "fsdp: prepare_async_checkpoint on rank ", subject.group.rank(), ": ", plan.error);
  return move_protectable_records(plan);
}

void settle_in_flight() {
  std::shared_ptr<AsyncSave> previous;
  {
    std::lock_guard<std::mutex> lock(slot_mutex());
    previous.swap(in_flight());
  }
  if (previous) previous->settle();
}

CheckpointHandle save_async_of(const std::string& dir, const CheckpointSubject& subject,
                               const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra,
                               const AsyncCheckpointOptions& options) {
  const auto t0 = Clock::now();
  CheckpointSaveStats stats;
  if (options.skip_if_busy() && previous_still_running(subject.group)) {
    ++skipped();
    if (subject.group.rank() == 0)
      std::fprintf(stderr, "fsdp: warning: save_checkpoint_async skipped '%s': the previous save is still being "
                   "written (skip_if_busy; %lld skipped so far)\n", dir.c_str(),
                   static_cast<long long>(skipped().load()));
    return CheckpointHandle();
  }
  settle_in_flight();
  stats.waited_previous_s = seconds_since(t0);
  StoreAgreement agree(subject.group, "save_checkpoint_async");
  SavePlan plan;
  {
    CheckpointSpan span(subject.tracer, "checkpoint snapshot " + dir, Tracer::kPhase);
    plan = plan_and_snapshot(dir, subject, optimizer, extra, snapshot_cap(options, subject.group), stats);
  }
  auto save = std::make_shared<AsyncSave>(std::move(plan), std::move(agree), stats);
  {
    std::lock_guard<std::mutex> lock(slot_mutex());
    in_flight() = save;
  }
  if (stats.blocking) save->wait();
  save->add_blocked(seconds_since(t0));
  return CheckpointHandle(save);
}

}  // namespace state::detail

bool CheckpointHandle::done() { return !save_ || save_->poll(); }

void CheckpointHandle::wait() {
  if (save_) save_->wait();
}

std::string CheckpointHandle::error() const { return save_ ? save_->error() : ""; }

CheckpointSaveStats CheckpointHandle::stats() const {
  if (save_) return save_->stats();
  CheckpointSaveStats skipped;
  skipped.skipped = true;
  return skipped;
}

void wait_for_checkpoints() { state::detail::settle_in_flight(); }

int64_t skipped_checkpoints() { return state::detail::skipped().load(); }

}  // namespace fsdp
