#pragma once
// Internal to src/comm: where each byte of a shared-memory collective travels, as pure
// arithmetic ([Note: shared-memory transport] in shm_channel.cpp). A rank's ring carries one
// stream of *fragments* (at most one slot of bytes each, numbered from 1 in the order
// written). Fragment numbers are never sent: every member computes, from the same inputs,
// how each writer cuts a stage into fragments (layout) and so which fragment of which
// writer's stream each of its reads takes (build_stage). Nothing here touches shared
// memory; the progress engine (shm_progress.cpp) carries the plans out.
#include <cstdint>
#include <utility>
#include <vector>

namespace fsdp::comm::detail::shm_plan {

/// Chunk p of a buffer: bytes [off[p], off[p] + len[p]).
struct Geometry {
  std::vector<int64_t> off, len;
};

/// One fragment of writer w's stream within a stage: which chunk, which part of it, for whom.
struct FragmentDesc {
  int chunk;
  int64_t off, len;
  int reader;  // -1: every peer
};

/// The order in which writer `w` of `n` cuts a stage into fragments of at most `slot`
/// bytes. gather: its own chunk, in order, for every peer. Otherwise (reduce): chunk p for
/// reader p, segment by segment (segment j for every peer, from w+1 on, before segment
/// j+1), so that all readers progress together.
std::vector<FragmentDesc> layout(bool gather, int w, int n, const Geometry& g, int64_t slot);

/// One fragment this rank writes into its ring.
struct Write {
  const char* src;
  int64_t bytes;
  uint64_t fragment;
  int reader;  // group rank, or -1: every peer
  // All-gather: where the fragment goes in this rank's own chunk of the output, copied
  // from the slot just written (still in cache) so that the shard is read once; null
  // when the shard already is that chunk.
  char* own_dst = nullptr;
  // >= 0: published in place ([Note: exchange arena] in shm_arena.cpp): the readers take the
  // bytes from this offset of our arena (the all-gather's own chunk once filled, or the
  // reduce-scatter's source), and the slot carries no data.
  int64_t arena_off = -1;
};

/// One step this rank takes from its peers' rings, in order.
struct Read {
  enum class Kind { kCopy, kReduce } kind;
  std::vector<std::pair<int, uint64_t>> fragments;  // (writer, fragment); Reduce: ascending writer
  char* dst;
  int64_t bytes;
  const char* own = nullptr;  // Reduce: this rank's row
  bool via_temp = false;      // Reduce: dst is our own row; sum into a temporary first
};

struct Stage {
  std::vector<Write> writes;
  std::vector<Read> reads;
  size_t next_write = 0, next_read = 0;
  // Fragments published in place, in order: the stage is complete only once every reader
  // has released them, because until then they read our memory.
  std::vector<uint64_t> in_place;
  size_t next_release = 0;
  bool complete() const {
    return next_write == writes.size() && next_read == reads.size() && next_release == in_place.size();
  }
};

/// This rank's exchange arena as the plan sees it: an address range. A write whose bytes lie
/// wholly inside it is published in place; an empty range (null base) publishes nothing so.
struct ArenaRange {
  const char* base = nullptr;
  int64_t bytes = 0;
  /// Offset of [p, p + len) in the range, or -1 when it is not entirely inside.
  int64_t offset_of(const void* p, int64_t len) const;
};

/// One stage as this rank `me` of `n` takes part in it: the chunks of `geo`, slots of
/// `slot` bytes, `assigned[w]` fragments already in writer w's stream (advanced past this
/// stage). gather: every rank's chunk (from `src`, ours) goes to every peer's `dst` at the
/// chunk's offset. Otherwise (reduce): chunk p of every rank's `src` goes to rank p, which
/// reduces them into `dst` (its own chunk's output), via a temporary when `via_temp`.
struct StageSpec {
  bool gather = true;
  int me = 0, n = 0;
  Geometry geo;
  int64_t slot = 0;
  const char* src = nullptr;
  char* dst = nullptr;
  bool via_temp = false;
  ArenaRange arena;
};

/// Appends to `st` this rank's writes and reads of the stage `spec` describes, and advances
/// every writer's fragment count in `assigned`.
void build_stage(Stage& st, const StageSpec& spec, std::vector<uint64_t>& assigned);

}  // namespace fsdp::comm::detail::shm_plan
