#pragma once
// Internal to src/core: the order of a runtime's streams and the buffers they share.
//
// [Note: stream order]
// On a GPU, FSDP runs three kinds of work on separate *streams*: compute (forward,
// backward, flattening gradients, the optimizer), all-gathers, reduce-scatters (and
// later copies for offload). Work on one stream runs in issue order; across streams
// nothing is ordered unless a stream *waits* on an *event* another stream *recorded*.
// A *buffer* (a pool block, a unit's unsharded flat storage, a flat gradient, a
// reduced shard) carries the event recorded behind its last *producer* (the last
// write) and behind each *consumer* since (reads, and the release that ends its life).
// The rules, each a hazard a missing wait causes:
//   read     a stream reads a buffer only after waiting on its producer's event;
//   write    a stream overwrites a buffer only after waiting on every event it carries;
//            a buffer is first written by the stream it was acquired for (allocated on);
//   release  a buffer is given back (to the pool or the allocator) by a stream that has
//            waited on every other stream's use of it: the allocator reuses it in that
//            stream's order, so a use it has not waited on may still be running;
//   acquire  a pool block handed to its next user: that user's stream has waited on the
//            event behind the block's last consumer. The pool bypasses the caching
//            allocator, so record_stream cannot protect it; only this wait does.
// The runtime declares every use and every wait here ([Note: stream order wiring] in
// runtime.h); the waits go through named WaitSites so that a test can plant a missing
// one. A StreamBackend does the work: FakeStreams (fake_streams.h) keeps the
// happened-before relation on the CPU and throws on any hazard; the CUDA backend
// (cuda_streams.h) records and waits real events and checks nothing. Without a backend
// (plain CPU training) every call returns at once.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp/core/trace.h"

namespace fsdp::core::detail {

enum class StreamKind : uint8_t {
  kCompute,        // forward, backward, gradient flattening, optimizer steps
  kAllGather,      // the units' all-gathers
  kReduceScatter,  // gradient reductions (reduce-scatter or all-reduce, replica all-reduce)
  kCopy,           // reserved: device <-> host copies (offload)
};
constexpr int kStreamKinds = 4;
const char* to_string(StreamKind s);

/// A backend's own event (a fake clock, a CUDA event).
struct EventImpl {
  virtual ~EventImpl() = default;
};

/// An event recorded on `stream` behind everything issued to it so far.
struct StreamEvent {
  StreamKind stream = StreamKind::kCompute;
  std::string what;  // what it was recorded behind, for messages
  std::shared_ptr<EventImpl> impl;
};

enum class BufferUse { kRead, kWrite, kRelease, kAcquire };
const char* to_string(BufferUse u);

/// One buffer as the stream order sees it.
struct BufferRecord {
  std::string name;  // "unsharded flat parameter of unit 'l1'"
  StreamKind owner = StreamKind::kCompute;  // the stream it was acquired for
  bool released = false;                   // back in the pool (or freed)
  bool written = false;                    // since acquired
  std::vector<StreamEvent> producer;       // behind the last write (zero or one)
  std::vector<StreamEvent> consumers;      // behind each read since, and the release
};

/// The backend interface: records and waits events; checks a use against the events the
/// buffer carries (FakeStreams throws on a hazard; a device backend checks nothing).
class StreamBackend {
 public:
  virtual ~StreamBackend() = default;
  /// An event on `s` behind all work issued to it so far.
  virtual StreamEvent record(StreamKind s, std::string what) = 0;
  /// Work issued to `s` from now on runs after `e`.
  virtual void wait(StreamKind s, const StreamEvent& e) = 0;
  /// `s` is about to use `b` as `use`; throws if the order does not allow it.
  virtual void check(StreamKind s, BufferUse use, const BufferRecord& b) = 0;
  /// Makes `s` this thread's current stream until the returned guard dies, so that a
  /// collective issued meanwhile queues behind `s` (NCCL's stream waits the current one);
  /// null where the streams are not real.
  virtual std::shared_ptr<void> make_current(StreamKind) { return nullptr; }
  /// The pool made a new device block that every stream may use: its memory must not go
  /// back to the device allocator before their work on it is done.
  virtual void adopt_block(const at::DataPtr&) {}
  /// Device times for the trace (tracer tids 0, 1, 2: compute, all-gather, reduce-scatter);
  /// null where the streams are not real.
  virtual std::shared_ptr<DeviceClock> device_clock() { return nullptr; }
};

/// The waits the runtime makes, by name ([Note: stream order wiring] in runtime.h).
enum class WaitSite {
  kGatherWaitsCompute,  // before an all-gather overwrites a block compute used
  kComputeWaitsGather,  // before compute reads a gathered flat parameter
  kReduceWaitsCompute,  // before a reduction reads the flat gradient compute wrote
  kComputeWaitsReduce,  // before compute reads a reduced shard
};
const char* to_string(WaitSite w);

/// The runtime's front: buffers by their storage's address, uses, waits. Every call
/// returns at once without a backend.
class StreamOrder {
 public:
  StreamOrder() = default;
  void set_backend(std::shared_ptr<StreamBackend> backend) { backend_ = std::move(backend); }
  bool enabled() const { return backend_ != nullptr; }
  /// Test-only: the wait at `site` is not made (a planted missing wait).
  void set_skipped_wait(std::optional<WaitSite> site) { skipped_ = site; }
  /// Test-only: the all-gather handle's own wait goes to the copy stream, not compute
  /// (StreamOrderTestHooks::gather_handle_wait_off_compute).
  void set_gather_handle_wait_off_compute(bool off) { gather_handle_wait_off_compute_ = off; }
  bool gather_handle_wait_off_compute() const { return gather_handle_wait_off_compute_; }

  // ---- buffers (keyed by t's storage; named "<what> of '<owner>'") ----
  /// A pool block becomes a new buffer for stream `s` (fresh: memory the pool or the
  /// allocator just made, with no history).
  void acquire(StreamKind s, const at::Tensor& t, const char* what, const std::string& owner, bool fresh = false);
  void read(StreamKind s, const at::Tensor& t);
  void write(StreamKind s, const at::Tensor& t);
  /// `s` gives the buffer back; the event behind its last use on `s` stays with the
  /// block for its next user.
  void release(StreamKind s, const at::Tensor& t);
  /// The pool allocated a new block: whatever was at its address before is gone.
  void new_block(const at::DataPtr& block);

  // ---- the issuing thread's current stream ----
  /// While the result lives, `s` is this thread's current stream (nothing without real
  /// streams). Safe from any thread: it reads only the backend.
  std::shared_ptr<void> make_current(StreamKind s) const { return backend_ ? backend_->make_current(s) : nullptr; }
  /// make_current(s) for another thread, which may outlive this StreamOrder (empty: none).
  /// The backend's device clock for the trace (null: none).
  std::shared_ptr<DeviceClock> device_clock() const { return backend_ ? backend_->device_clock() : nullptr; }
  std::function<std::shared_ptr<void>()> current_maker(StreamKind s) const {
    if (!backend_) return nullptr;
    return [backend = backend_, s] { return backend->make_current(s); };
  }

  // ---- events ----
  StreamEvent record(StreamKind s, std::string what);
  /// `s` waits `e` at `site` (unless planted missing).
  void wait(WaitSite site, StreamKind s, const StreamEvent& e);
  /// `s` waits the event behind the buffer's last write.
  void wait_written(WaitSite site, StreamKind s, const at::Tensor& t);

 private:
  /// Null for a buffer without memory (an empty flat parameter): nothing to order.
  BufferRecord* record_of(const at::Tensor& t, const char* op);
  static const void* key(const at::Tensor& t);

  std::shared_ptr<StreamBackend> backend_;
  std::optional<WaitSite> skipped_;
  bool gather_handle_wait_off_compute_ = false;
  std::unordered_map<const void*, BufferRecord> buffers_;
};

}  // namespace fsdp::core::detail
