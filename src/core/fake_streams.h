#pragma once
// Internal to src/core: the stream order's CPU backend ([Note: stream order] in
// stream_order.h). Nothing runs asynchronously: FakeStreams only keeps the
// happened-before relation of the streams, as vector clocks, and checks every use of a
// buffer against it, throwing on the first hazard with the stream, the buffer, the
// event and the wait that is missing. So the CPU CI sees the stream races a GPU would
// only show now and then.
//
// Clocks: clock_[s][t] is the last event of stream t that stream s is ordered after
// (its own events for t == s). record(s) advances clock_[s][s] and stamps the event
// with clock_[s]; wait(s, e) raises clock_[s] to e's stamp. Event e of stream t is
// ordered before s's next work when t == s or clock_[s][t] >= e's position.
#include <array>
#include <cstdint>

#include "stream_order.h"

namespace fsdp::core::detail {

class FakeStreams : public StreamBackend {
 public:
  StreamEvent record(StreamKind s, std::string what) override;
  void wait(StreamKind s, const StreamEvent& e) override;
  void check(StreamKind s, BufferUse use, const BufferRecord& b) override;

  /// Waits of `waiter` on an event of another stream, `signaller`.
  int64_t waits(StreamKind waiter, StreamKind signaller) const {
    return waits_[index(waiter)][index(signaller)];
  }
  int64_t events() const { return events_; }
  int64_t checks() const { return checks_; }
  void reset_counts();
  /// Whether `e` is ordered before work issued to `s` now.
  bool ordered(const StreamEvent& e, StreamKind s) const;

 private:
  using Clock = std::array<int64_t, kStreamKinds>;
  struct FakeEvent : EventImpl {
    Clock stamp{};
  };
  static size_t index(StreamKind s) { return static_cast<size_t>(s); }
  void require(StreamKind s, BufferUse use, const BufferRecord& b, const StreamEvent& e, const char* hazard) const;

  std::array<Clock, kStreamKinds> clock_{};
  std::array<std::array<int64_t, kStreamKinds>, kStreamKinds> waits_{};
  int64_t events_ = 0;
  int64_t checks_ = 0;
};

}  // namespace fsdp::core::detail
