#pragma once
// Where the optimizer steps a piece inside backward (FSDP's Options::optimizer_in_backward: a
// unit's reduced shard; ZeRO's ZeroOptions::optimizer_in_backward: a bucket's chunk of the
// partition): the contract both keep.
//
// [Note: stepping in backward]
// A piece is stepped the moment its final reduction of the iteration arrives, by the user's
// one optimizer, seeing only that piece's gradients, so each parameter is stepped once per
// iteration with exactly the gradient it would have after backward (per-parameter optimizers
// make that bitwise equal to one step after backward). Under offload the step of an offloaded
// piece runs on a host thread while backward goes on ([Note: host steps] in
// host_step_queue.h). A piece on the device steps on the backward thread, now, after the host
// steps posted before it: they step the same optimizer, so its steps stay in reduce order.
// The optimizer and the posted pieces are the host thread's until drain(): at the end of
// backward (FSDP) or in step() (ZeRO). FSDP's side: [Note: optimizer in backward] in
// src/core/backward_optimizer.h; ZeRO's: [Note: ZeRO-2 gradient buckets] in
// src/optim/zero_bucket_reducer.h.
#include <functional>
#include <memory>

#include <c10/core/Device.h>

namespace fsdp::engine {

class HostStepQueue;

class InBackwardSteps {
 public:
  /// host_thread: offloaded pieces step on a thread of their own, whose current device is
  /// `device` (the model's).
  InBackwardSteps(bool host_thread, const c10::Device& device);
  ~InBackwardSteps();

  /// Runs one piece's step: posted to the host thread when the piece is offloaded and there
  /// is one, else now, once the posted steps have run.
  void run(std::function<void()> step, bool offloaded);
  /// Returns once every posted step has run; rethrows the first error one threw.
  void drain();
  /// Offloaded pieces step on a thread of their own.
  bool on_host_thread() const { return host_steps_ != nullptr; }

 private:
  std::unique_ptr<HostStepQueue> host_steps_;
};

}  // namespace fsdp::engine
