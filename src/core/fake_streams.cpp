#include "fake_streams.h"

#include <algorithm>

namespace fsdp::core::detail {

// The hazards, as the messages name them (tests look for these words).
namespace hazard {
constexpr const char* kRead = "read without waiting for its producer";
constexpr const char* kOverwrite = "overwritten without waiting for its last users";
constexpr const char* kForeignFirstWrite = "first written by a stream it was not allocated on";
constexpr const char* kFree = "freed while a stream may still use it";
constexpr const char* kReuse = "pool block reused before its next user waited on the event behind its last consumer";
}  // namespace hazard

StreamEvent FakeStreams::record(StreamKind s, std::string what) {
  Clock& c = clock_[index(s)];
  ++c[index(s)];
  ++events_;
  auto ev = std::make_shared<FakeEvent>();
  ev->stamp = c;
  return StreamEvent{s, std::move(what), std::move(ev)};
}

void FakeStreams::wait(StreamKind s, const StreamEvent& e) {
  const auto* fe = dynamic_cast<const FakeEvent*>(e.impl.get());
  TORCH_INTERNAL_ASSERT(fe, "FakeStreams waits on an event another backend recorded");
  Clock& c = clock_[index(s)];
  for (size_t t = 0; t < c.size(); ++t) c[t] = std::max(c[t], fe->stamp[t]);
  if (s != e.stream) ++waits_[index(s)][index(e.stream)];
}

bool FakeStreams::ordered(const StreamEvent& e, StreamKind s) const {
  if (e.stream == s) return true;
  const auto* fe = dynamic_cast<const FakeEvent*>(e.impl.get());
  TORCH_INTERNAL_ASSERT(fe, "FakeStreams checks an event another backend recorded");
  return clock_[index(s)][index(e.stream)] >= fe->stamp[index(e.stream)];
}

void FakeStreams::require(StreamKind s, BufferUse use, const BufferRecord& b, const StreamEvent& e,
                          const char* what) const {
  TORCH_CHECK(ordered(e, s), "fsdp stream-order hazard (", what, "): the ", to_string(s), " stream would ",
              use == BufferUse::kAcquire ? "reuse the pool block of the" : use == BufferUse::kRelease ? "free the" : (
              use == BufferUse::kRead ? "read the" : "write the"), " ", b.name, " before waiting on the event the ", to_string(e.stream),
              " stream recorded behind ", e.what, ". Missing wait: ", to_string(s), " waits ",
              to_string(e.stream), " (StreamOrder::wait on that event) before this ", to_string(use),
              " ([Note: stream order] in src/core/stream_order.h)");
}

void FakeStreams::check(StreamKind s, BufferUse use, const BufferRecord& b) {
  ++checks_;
  switch (use) {
    case BufferUse::kRead:
      for (const auto& e : b.producer) require(s, use, b, e, hazard::kRead);
      return;
    case BufferUse::kWrite:
      TORCH_CHECK(b.written || s == b.owner, "fsdp stream-order hazard (", hazard::kForeignFirstWrite, "): the ",
                  b.name, " was acquired for the ", to_string(b.owner), " stream but is first written by the ",
                  to_string(s), " stream; acquire it for the stream that writes it, so the allocator orders its "
                  "reuse after that stream ([Note: stream order] in src/core/stream_order.h)");
      for (const auto& e : b.producer) require(s, use, b, e, hazard::kOverwrite);
      for (const auto& e : b.consumers) require(s, use, b, e, hazard::kOverwrite);
      return;
    case BufferUse::kRelease:
      for (const auto& e : b.producer) require(s, use, b, e, hazard::kFree);
      for (const auto& e : b.consumers) require(s, use, b, e, hazard::kFree);
      return;
    case BufferUse::kAcquire:
      for (const auto& e : b.producer) require(s, use, b, e, hazard::kReuse);
      for (const auto& e : b.consumers) require(s, use, b, e, hazard::kReuse);
      return;
  }
}

void FakeStreams::reset_counts() {
  waits_ = {};
  events_ = 0;
  checks_ = 0;
}

}  // namespace fsdp::core::detail
