#pragma once
// Internal to src/state: a save's records read out of a copy-on-write snapshot.
//
// [Note: records on shared pages]
// CowSnapshot hands out whole pages, each once, and gives a page back to training as soon
// as it is taken. Records are element ranges: two records of one storage (two parameters
// of one flat shard) can meet inside a page, and whichever is written first takes that
// page. So when a take covers a page only partly, the reader keeps a copy of that page (as
// it was at the snapshot) for the record that holds the rest: at most two pages per record.

#include <cstddef>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "memory/cow_snapshot.h"

namespace fsdp::state {

class SnapshotReader {
 public:
  using Sink = std::function<void(const char*, size_t)>;
  explicit SnapshotReader(memory::CowSnapshot& cow);

  /// The bytes [offset, offset + bytes) of region `region` as they were at the snapshot,
  /// to `sink` in order (pieces of any size).
  void read(size_t region, size_t offset, size_t bytes, const Sink& sink);

 private:
  void take_run(size_t region, size_t first_page, size_t last_page, size_t begin, size_t end, const Sink& sink);

  memory::CowSnapshot& cow_;
  size_t page_;
  std::map<std::pair<size_t, size_t>, std::vector<char>> kept_;  // (region, page) -> its bytes at the snapshot
};

}  // namespace fsdp::state
