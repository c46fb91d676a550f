#pragma once
/// The global mean loss of each training step, all-reduced in the background so that
/// the reduction does not hold up the next step. Used by fsdp::trainer::Trainer's loop
/// (TrainerOptions::overlap_step_metrics) and usable by a hand-written loop.
///
/// [Note: overlapped step loss]
/// A step's loss is a scalar every rank computes on its own samples; the global mean
/// needs one all-reduce of a few bytes over the whole world. Waited for at once, that
/// all-reduce is a synchronisation point on the critical path of every step: across
/// hosts it costs a round of network latency per rank hop (docs/benchmarks.md), and
/// it makes the fastest rank wait for the slowest before its next forward.
/// Started instead right after the optimizer step and taken back after the *next*
/// step's optimizer step, it runs on the transport's threads while that step computes,
/// and costs nothing when it is done by then. The price is that step s's metrics are
/// known one step later (after step s+1's optimizer step); anything that must run
/// between steps s and s+1 with step s's loss has to wait for it (finish_all).
///
/// Every rank must call start() and finish_*() in the same order (the all-reduces are
/// collectives on the group, issued in order like every other).

#include <cstdint>
#include <deque>

#include <ATen/core/Tensor.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/trainer/callback.h"

namespace fsdp::trainer {

class StepLossReduction {
 public:
  explicit StepLossReduction(comm::ProcessGroup group) : group_(std::move(group)) {}
  /// Not copyable: the in-flight all-reduces write into tensors it owns.
  StepLossReduction(const StepLossReduction&) = delete;
  StepLossReduction& operator=(const StepLossReduction&) = delete;
  /// Waits for anything still in flight (the collectives must complete before their
  /// tensors go), swallowing errors: a destructor runs while an exception unwinds.
  ~StepLossReduction();

  /// Starts the all-reduce (a sum over ranks) of this rank's `local` for the step
  /// `metrics` describes; its loss becomes sum / `divisor` (e.g. local = this rank's
  /// loss x samples, divisor = the global batch's samples; or local = this rank's mean,
  /// divisor = world size).
  void start(const StepMetrics& metrics, double local, double divisor);
  /// Steps started and not yet finished.
  size_t in_flight() const { return pending_.size(); }
  /// Waits for the oldest started step and returns its metrics with `loss` set: the
  /// global value. Throws (c10::Error from the collective) if the group fails.
  StepMetrics finish_oldest();

 private:
  struct Pending {
    StepMetrics metrics;
    at::Tensor value;  ///< float64 [1], reduced in place
    comm::CommHandle handle;
    double divisor = 1;
  };
  comm::ProcessGroup group_;
  std::deque<Pending> pending_;
};

}  // namespace fsdp::trainer
