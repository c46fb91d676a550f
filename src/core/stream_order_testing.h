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

namespace fsdp::detail {

struct StreamOrderTestHooks {
  /// Called once per new runtime; empty (the default): no stream order.
  std::function<std::shared_ptr<StreamBackend>()> make_backend;
  /// The wait the runtime leaves out (a planted hazard).
  std::optional<WaitSite> skipped_wait;
  /// On a GPU: every collective issued on this stream first waits a spin kernel of
  /// `delay_cycles` there, so that a missing wait shows as wrong values, not luck.
  std::optional<StreamKind> delayed_stream;
  int64_t delay_cycles = 0;
};

void set_stream_order_test_hooks(StreamOrderTestHooks hooks);
const StreamOrderTestHooks& stream_order_test_hooks();

}  // namespace fsdp::detail
