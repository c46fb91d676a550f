#pragma once
// One thread that runs tasks in the order they are posted: ZeroRedundancyOptimizer's steps
// on the host under cpu_offload with optimizer_in_backward.
//
// [Note: host steps]
// Stepping a bucket's chunk where its reduction completes would hold backward for as long as
// the host's optimizer takes: on a GPU the device would idle while CPUAdam runs. Instead the
// hook starts the chunk's copy to the host (asynchronous into pinned memory, an event
// recorded after it) and posts the step here; the thread waits for the event, steps, and
// takes the next bucket, while backward goes on issuing kernels and reductions (DeepSpeed's
// ZeRO-Offload overlaps its CPU Adam with backward the same way). The inner optimizer is
// touched by this thread alone until step() drains the queue, and the collectives stay on
// the thread that issues them (the per-bucket agreement runs in the hook, before the post).
// The thread uses as many intra-op threads as the thread that made the queue.
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace fsdp::optim::detail {

class HostStepQueue {
 public:
  HostStepQueue();
  /// Waits for the posted tasks (an error then is dropped: step() reports errors) and joins.
  ~HostStepQueue();
  HostStepQueue(const HostStepQueue&) = delete;
  HostStepQueue& operator=(const HostStepQueue&) = delete;

  void post(std::function<void()> task);
  /// Returns once every posted task has run; rethrows the first error a task threw (the
  /// tasks after it are skipped: the steps they would take depend on the failed one).
  void drain();

 private:
  void run(int intra_op_threads);

  std::mutex mu_;
  std::condition_variable work_, idle_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace fsdp::optim::detail
