#include "stream_order.h"

#include "stream_order_testing.h"

namespace fsdp::core::detail {

const char* to_string(StreamKind s) {
  switch (s) {
    case StreamKind::kCompute: return "compute";
    case StreamKind::kAllGather: return "all-gather";
    case StreamKind::kReduceScatter: return "reduce-scatter";
    case StreamKind::kCopy: return "copy";
  }
  return "?";
}

const char* to_string(BufferUse u) {
  switch (u) {
    case BufferUse::kRead: return "read";
    case BufferUse::kWrite: return "write";
    case BufferUse::kRelease: return "release";
    case BufferUse::kAcquire: return "acquire";
  }
  return "?";
}

const char* to_string(WaitSite w) {
  switch (w) {
    case WaitSite::kGatherWaitsCompute: return "all-gather waits compute";
    case WaitSite::kComputeWaitsGather: return "compute waits all-gather";
    case WaitSite::kReduceWaitsCompute: return "reduce-scatter waits compute";
    case WaitSite::kComputeWaitsReduce: return "compute waits reduce-scatter";
  }
  return "?";
}

// ---- test hooks (stream_order_testing.h) ----

namespace {
StreamOrderTestHooks& stream_order_hooks() {
  static StreamOrderTestHooks h;
  return h;
}
}  // namespace

void set_stream_order_test_hooks(StreamOrderTestHooks h) { stream_order_hooks() = std::move(h); }
const StreamOrderTestHooks& stream_order_test_hooks() { return stream_order_hooks(); }

// ---- buffers ----

const void* StreamOrder::key(const at::Tensor& t) { return t.storage().data(); }

BufferRecord* StreamOrder::record_of(const at::Tensor& t, const char* op) {
  const void* k = key(t);
  if (k == nullptr) return nullptr;
  auto it = buffers_.find(k);
  TORCH_INTERNAL_ASSERT(it != buffers_.end(), "stream order: ", op,
                        " of a buffer that was never acquired (every buffer a stream uses starts with acquire)");
  return &it->second;
}

void StreamOrder::acquire(StreamKind s, const at::Tensor& t, const char* what, const std::string& owner, bool fresh) {
  if (!backend_) return;
  const void* k = key(t);
  if (k == nullptr) return;
  auto it = buffers_.find(k);
  if (it != buffers_.end() && !fresh) backend_->check(s, BufferUse::kAcquire, it->second);
  BufferRecord r;
  r.name = std::string(what) + " of '" + owner + "'";
  r.owner = s;
  buffers_[k] = std::move(r);
}

void StreamOrder::read(StreamKind s, const at::Tensor& t) {
  if (!backend_) return;
  BufferRecord* b = record_of(t, "read");
  if (!b) return;
  backend_->check(s, BufferUse::kRead, *b);
  b->consumers.push_back(backend_->record(s, "a read of the " + b->name));
}

void StreamOrder::write(StreamKind s, const at::Tensor& t) {
  if (!backend_) return;
  BufferRecord* b = record_of(t, "write");
  if (!b) return;
  backend_->check(s, BufferUse::kWrite, *b);
  // Every earlier use is ordered before this write (checked), so the write's event covers them.
  b->written = true;
  b->consumers.clear();
  b->producer.assign(1, backend_->record(s, "the write of the " + b->name));
}

void StreamOrder::release(StreamKind s, const at::Tensor& t) {
  if (!backend_) return;
  BufferRecord* b = record_of(t, "release");
  if (!b) return;
  backend_->check(s, BufferUse::kRelease, *b);
  b->released = true;
  b->consumers.push_back(backend_->record(s, "the release of the " + b->name));
}

void StreamOrder::new_block(const at::DataPtr& block) {
  if (!backend_) return;
  buffers_.erase(block.get());
  backend_->adopt_block(block);
}

// ---- events ----

StreamEvent StreamOrder::record(StreamKind s, std::string what) {
  if (!backend_) return {};
  return backend_->record(s, std::move(what));
}

void StreamOrder::wait(WaitSite site, StreamKind s, const StreamEvent& e) {
  if (!backend_ || !e.impl || skipped_ == site) return;
  backend_->wait(s, e);
}

void StreamOrder::wait_written(WaitSite site, StreamKind s, const at::Tensor& t) {
  if (!backend_) return;
  const BufferRecord* b = record_of(t, "wait for the write");
  if (!b) return;
  for (const StreamEvent& e : b->producer) wait(site, s, e);
}

}  // namespace fsdp::core::detail
