#pragma once
// One thread that runs tasks in the order they are posted: the optimizer steps on the host
// under offload with the optimizer in backward (cpu_offload, FSDP's and ZeRO's).
//
// [Note: host steps]
// Stepping a unit's shard (a bucket's chunk) where its reduction completes would hold
// backward for as long as the host's optimizer takes: on a GPU the device would idle while
// CPUAdam runs. Instead the hook copies the reduced gradient to pinned host memory (ZeRO:
// queued without waiting, an event recorded after it; FSDP: blocking, its source may be a
// pooled reduction buffer) and posts the step here; the thread waits for the event if any,
// steps, and takes the next one, while backward goes on issuing
// kernels and reductions (DeepSpeed's ZeRO-Offload overlaps its CPU Adam with backward the
// same way). The optimizer, and the parameters and gradients of the units (buckets) posted,
// are this thread's alone until the queue is drained: at the end of backward (FSDP) or in
// step() (ZeRO). A step there sees only its own parameters (FSDP narrows the optimizer's
// groups to the unit's for its duration), so it never reads a gradient autograd is writing.
// Collectives stay on the thread that issues them (ZeRO's per-bucket agreement runs in the
// hook, before the post). The thread uses as many intra-op threads as the thread that made
// the queue, and the model's device is its current device (a new thread starts on device 0,
// which on a host with several GPUs is another rank's).
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <memory>
#include <thread>

#include <c10/core/Device.h>
#include <c10/core/Event.h>

namespace fsdp::engine {

/// An event after the work queued so far on `device`'s current stream, for a host thread
/// to wait on (c10::Event::synchronize); null for the CPU, whose copies are done when they
/// return.
std::shared_ptr<c10::Event> event_after_queued_work(const c10::Device& device);

/// Makes `device` the calling thread's current device (nothing for the CPU): CUDA work a
/// thread issues without naming a device (streams, events, allocations) goes there.
void make_device_current(const c10::Device& device);

class HostStepQueue {
 public:
  /// `device`: the model's, made current on the thread (nothing for the CPU).
  explicit HostStepQueue(const c10::Device& device);
  /// Waits for the posted tasks (an error then is dropped: step() reports errors) and joins.
  ~HostStepQueue();
  HostStepQueue(const HostStepQueue&) = delete;
  HostStepQueue& operator=(const HostStepQueue&) = delete;

  void post(std::function<void()> task);
  /// Returns once every posted task has run; rethrows the first error a task threw (the
  /// tasks after it are skipped: the steps they would take depend on the failed one).
  void drain();

 private:
  void run(int intra_op_threads, c10::Device device);

  std::mutex mu_;
  std::condition_variable work_, idle_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace fsdp::engine
