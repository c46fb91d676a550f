#pragma once
// Internal to the library, for tests (they have src/ on their include path): switches the
// stream order ([Note: stream order] in stream_order.h) on for the runtimes built while
// set, with a backend of the test's choosing (FakeStreams on the CPU), and plants a
// missing wait to prove the checker is live. Process-wide; read when a runtime is built.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "stream_order.h"

namespace fsdp::core::detail {

struct StreamOrderTestHooks {
  /// Called once per new runtime; empty (the default): no stream order.
  std::function<std::shared_ptr<StreamBackend>()> make_backend;
  /// The wait the runtime leaves out (a planted hazard).
  std::optional<WaitSite> skipped_wait;
  /// On a GPU: a spin kernel of `delay_cycles` before each collective's issue, on this
  /// stream (all-gather, reduce-scatter: their collectives run late; compute: the work they
  /// must wait for runs late), so that a missing wait shows as wrong values, not luck.
  std::optional<StreamKind> delayed_stream;
  int64_t delay_cycles = 0;
  /// On a GPU: the all-gather handle's own wait (which orders the waiting thread's current
  /// stream after the collective) is made with the copy stream current, which compute never
  /// waits: compute then waits the gather only through the stream order.
  bool gather_handle_wait_off_compute = false;
};

void set_stream_order_test_hooks(StreamOrderTestHooks hooks);
const StreamOrderTestHooks& stream_order_test_hooks();

}  // namespace fsdp::core::detail
