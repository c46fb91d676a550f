#pragma once
// The reductions in flight: every bucketed collective FSDP and ZeRO issue while training
// (FSDP's gradient reductions and their HYBRID_SHARD replica all-reduces; ZeRO-2's
// reductions in backward; ZeRO-1's reductions and ZeRO's parameter all-gathers in step())
// passes through one ReductionWindow.
//
// [Note: reductions in flight]
// A window holds the collectives issued and not yet completed, oldest first, at most
// max_in_flight of them. Before a new one is issued the oldest are completed until there is
// room (make_room), so the memory a reduction holds (its bucket) is bounded by the window,
// not by the model. Completing a reduction waits for its collective and delivers its result
// (the owner says how: the Reduction's complete()); reductions complete in the order issued,
// so every rank delivers in the same order. complete_landed() delivers, oldest first, those
// whose collective already finished, without blocking (FSDP steps a unit inside backward as
// soon as its reduction lands). The window sizes are the owners' (FSDP: [Note: reduce
// buckets] in src/core/grad_reducer.h; ZeRO: overlap_communication, two in flight).
#include <deque>
#include <functional>
#include <memory>

#include "fsdp/comm/collectives.h"

namespace fsdp::engine {

class ReductionWindow {
 public:
  /// One issued collective, as its owner completes it.
  class Reduction {
   public:
    virtual ~Reduction() = default;
    /// Whether its collective has completed, asked without blocking (CommHandle::is_completed).
    virtual bool landed() const = 0;
    /// Waits for the collective and delivers the result.
    virtual void complete() = 0;
    /// Bytes of the bucket it holds until completed (memory accounting).
    virtual int64_t held_bytes() const { return 0; }
  };

  /// Receives each reduction once completed (its owner may keep it: HYBRID_SHARD's second
  /// phase); without one it is destroyed.
  using AfterComplete = std::function<void(std::unique_ptr<Reduction>)>;

  /// max_in_flight >= 1; 0 or less: unbounded (a window that only orders completion).
  explicit ReductionWindow(int max_in_flight, AfterComplete after = {});

  /// Completes the oldest reductions until one more fits.
  void make_room();
  /// A reduction just issued joins, newest. The window must have room (make_room first).
  void push(std::unique_ptr<Reduction> r);
  /// Completes the oldest.
  void complete_oldest();
  /// Whether the oldest has landed (false when empty).
  bool oldest_landed() const { return !in_flight_.empty() && in_flight_.front()->landed(); }
  /// Completes, oldest first, each reduction that has already landed; stops at the first
  /// still in flight, so deliveries keep their order.
  void complete_landed();
  /// Completes every reduction, oldest first.
  void complete_all();

  bool empty() const { return in_flight_.empty(); }
  int size() const { return static_cast<int>(in_flight_.size()); }
  int64_t held_bytes() const;

 private:
  bool full() const { return max_in_flight_ > 0 && size() >= max_in_flight_; }

  int max_in_flight_;
  AfterComplete after_;
  std::deque<std::unique_ptr<Reduction>> in_flight_;  // oldest first
};

/// A reduction whose completion is its handle's wait, then `done`.
class HandleReduction : public ReductionWindow::Reduction {
 public:
  HandleReduction(comm::CommHandle handle, std::function<void()> done)
      : handle_(std::move(handle)), done_(std::move(done)) {}
  bool landed() const override { return !handle_.defined() || handle_.is_completed(); }
  void complete() override {
    handle_.wait();
    if (done_) done_();
  }

 private:
  comm::CommHandle handle_;
  std::function<void()> done_;
};

/// One collective per bucket: issue(b) issues bucket b's and returns its handle, at most
/// `window` in flight, and done(b) runs once bucket b's completed, in bucket order.
template <typename Issue, typename Done>
void for_each_bucket(int num_buckets, int window, Issue issue, Done done) {
  ReductionWindow w(window);
  for (int b = 0; b < num_buckets; ++b) {
    w.make_room();
    w.push(std::make_unique<HandleReduction>(issue(b), [&done, b] { done(b); }));
  }
  w.complete_all();
}

}  // namespace fsdp::engine
