// See [Note: records on shared pages] in snapshot_reader.h.
#include "snapshot_reader.h"

#include <sys/uio.h>

#include <algorithm>

#include "memory/page_mapping.h"

namespace fsdp::state {

SnapshotReader::SnapshotReader(memory::CowSnapshot& cow) : cow_(cow), page_(memory::PageMapping::page_size()) {}

void SnapshotReader::read(size_t region, size_t offset, size_t bytes, const Sink& sink) {
  if (bytes == 0) return;
  const size_t begin = offset, end = offset + bytes;
  const size_t first = begin / page_, last = (end - 1) / page_;
  for (size_t p = first; p <= last;) {
    const auto kept = kept_.find({region, p});
    if (kept != kept_.end()) {  // taken by an earlier record: its copy
      const size_t lo = std::max(begin, p * page_), hi = std::min(end, (p + 1) * page_);
      sink(kept->second.data() + (lo - p * page_), hi - lo);
      ++p;
      continue;
    }
    size_t q = p;  // the run of pages not taken yet
    while (q < last && kept_.find({region, q + 1}) == kept_.end()) ++q;
    take_run(region, p, q, begin, end, sink);
    p = q + 1;
  }
}

// Takes pages [first, last] of `region`, hands the part inside [begin, end) to `sink`, and
// keeps a copy of each page this record covers only partly.
void SnapshotReader::take_run(size_t region, size_t first, size_t last, size_t begin, size_t end,
                              const Sink& sink) {
  size_t pos = first * page_;  // region offset of the next byte take() hands over
  cow_.take(region, pos, (last - first + 1) * page_, [&](const struct iovec* iov, int n) {
    for (int i = 0; i < n; ++i) {
      const char* base = static_cast<const char*>(iov[i].iov_base);
      const size_t len = iov[i].iov_len;
      for (size_t at = 0; at < len; at += page_) {  // pages shared with another record
        const size_t page_start = pos + at;
        if (page_start < begin || page_start + page_ > end)
          kept_[{region, page_start / page_}].assign(base + at, base + at + page_);
      }
      const size_t lo = std::max(begin, pos), hi = std::min(end, pos + len);
      if (lo < hi) sink(base + (lo - pos), hi - lo);
      pos += len;
    }
  });
}

}  // namespace fsdp::state
