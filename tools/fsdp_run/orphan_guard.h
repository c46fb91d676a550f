#pragma once
/// Makes sure nothing of the job outlives fsdp-run, even when fsdp-run is killed without a
/// chance to clean up (SIGKILL, the OOM killer, a crash).
///
/// PR_SET_PDEATHSIG covers each rank's own process, but not the processes a rank starts
/// (`sh -c 'train; ...'`, data-loader workers): those are in the rank's process group but
/// would be re-parented to init and keep running. The guard is a tiny helper process forked
/// before the ranks: fsdp-run tells it each rank's process-group id over a pipe. When the
/// pipe reaches EOF without a "released" message, fsdp-run is gone, and the guard SIGKILLs
/// every group it was told about, then exits.

#include <sys/types.h>

namespace fsdp::launcher {

class OrphanGuard {
 public:
  /// Forks the guard. If that fails, the job still runs, only without this safety net
  /// (a warning says so): the guard protects against an unlikely event and must not make
  /// fsdp-run itself less likely to work.
  OrphanGuard();
  /// Same as release().
  ~OrphanGuard();
  OrphanGuard(const OrphanGuard&) = delete;
  OrphanGuard& operator=(const OrphanGuard&) = delete;

  /// The guard will kill process group `pgid` if fsdp-run dies before release().
  void watch(pid_t pgid);
  /// The job ended normally: the guard exits without killing anything. Call before reaping
  /// the ranks, whose group ids may be reused by unrelated processes once reaped.
  void release();

 private:
  pid_t guard_pid_ = -1;
  int to_guard_ = -1;  // write end of the pipe the guard reads
};

}  // namespace fsdp::launcher
