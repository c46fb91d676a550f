// See shm_ring_layout.h.
#include "shm_ring_layout.h"

#include <algorithm>

namespace fsdp::comm::detail::shm_plan {

namespace {

int64_t longest_chunk(const Geometry& g, int n) {
  int64_t longest = 0;
  for (int p = 0; p < n; ++p) longest = std::max(longest, g.len[p]);
  return longest;
}

// This rank's writes: its own layout, numbered after the fragments already in its stream.
void plan_writes(Stage& st, const StageSpec& s, const std::vector<FragmentDesc>& mine, uint64_t base) {
  for (size_t k = 0; k < mine.size(); ++k) {
    const auto& d = mine[k];
    const char* from = s.gather ? s.src + d.off : s.src + s.geo.off[d.chunk] + d.off;
    char* own = s.gather ? s.dst + s.geo.off[s.me] + d.off : nullptr;
    // In place when what the readers take lies in our arena: the gathered own chunk
    // (filled from the shard first), or the reduce-scatter's source.
    const int64_t arena_off = s.arena.offset_of(s.gather ? own : from, d.len);
    st.writes.push_back({from, d.len, base + k + 1, d.reader, own == from ? nullptr : own, arena_off});
  }
}

// Gather: a copy of each peer's fragment into its chunk of `dst`, interleaved by offset so
// that every peer's stream drains evenly.
void plan_gather_reads(Stage& st, const StageSpec& s, const std::vector<uint64_t>& assigned) {
  const int n = s.n, me = s.me;
  const int64_t longest = longest_chunk(s.geo, n);
  for (int64_t o = 0, j = 0; o < longest; o += s.slot, ++j) {
    for (int k = 1; k < n; ++k) {
      const int w = (me + k) % n;
      if (o >= s.geo.len[w]) continue;
      Read r{Read::Kind::kCopy, {{w, assigned[w] + j + 1}}, s.dst + s.geo.off[w] + o,
             std::min(s.slot, s.geo.len[w] - o)};
      st.reads.push_back(std::move(r));
    }
  }
}

// Reduce: for each segment of our chunk, the fragments every peer wrote for us there, with
// our own row read in place.
void plan_reduce_reads(Stage& st, const StageSpec& s, const std::vector<std::vector<FragmentDesc>>& lay,
                       const std::vector<uint64_t>& assigned) {
  const int n = s.n, me = s.me;
  // Where in each writer's stream our segment at offset o sits.
  std::vector<std::vector<uint64_t>> fragment_of(static_cast<size_t>(n));
  for (int w = 0; w < n; ++w) {
    if (w == me) continue;
    for (size_t k = 0; k < lay[w].size(); ++k) {
      if (lay[w][k].reader == me) fragment_of[w].push_back(assigned[w] + k + 1);
    }
  }
  size_t j = 0;
  for (int64_t o = 0; o < s.geo.len[me]; o += s.slot, ++j) {
    Read r{Read::Kind::kReduce, {}, s.dst + o, std::min(s.slot, s.geo.len[me] - o)};
    r.own = s.src + s.geo.off[me] + o;
    r.via_temp = s.via_temp;
    for (int w = 0; w < n; ++w) {
      if (w != me) r.fragments.emplace_back(w, fragment_of[w].at(j));
    }
    st.reads.push_back(std::move(r));
  }
}

}  // namespace

std::vector<FragmentDesc> layout(bool gather, int w, int n, const Geometry& g, int64_t slot) {
  std::vector<FragmentDesc> out;
  if (gather) {
    for (int64_t o = 0; o < g.len[w]; o += slot) out.push_back({w, o, std::min(slot, g.len[w] - o), -1});
    return out;
  }
  const int64_t longest = longest_chunk(g, n);
  for (int64_t o = 0; o < longest; o += slot) {
    for (int k = 1; k < n; ++k) {
      const int p = (w + k) % n;
      if (o < g.len[p]) out.push_back({p, o, std::min(slot, g.len[p] - o), p});
    }
  }
  return out;
}

int64_t ArenaRange::offset_of(const void* p, int64_t len) const {
  if (base == nullptr) return -1;
  const char* c = static_cast<const char*>(p);
  if (c < base || len < 0 || c + len > base + bytes) return -1;
  return c - base;
}

void build_stage(Stage& st, const StageSpec& spec, std::vector<uint64_t>& assigned) {
  const int n = spec.n;
  std::vector<std::vector<FragmentDesc>> lay(static_cast<size_t>(n));
  for (int w = 0; w < n; ++w) lay[w] = layout(spec.gather, w, n, spec.geo, spec.slot);
  plan_writes(st, spec, lay[spec.me], assigned[spec.me]);
  if (spec.gather) {
    plan_gather_reads(st, spec, assigned);
  } else {
    plan_reduce_reads(st, spec, lay, assigned);
  }
  for (int w = 0; w < n; ++w) assigned[w] += lay[w].size();
}

}  // namespace fsdp::comm::detail::shm_plan
