// The shared-memory rings' plan, as arithmetic (src/comm/shm/shm_ring_layout.h): how each
// writer cuts a stage into fragments, and which fragment of which stream each read takes.
// One process, no shared memory: the plans of every rank of a group are built side by side
// and held against each other.
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "comm/shm/shm_ring_layout.h"

namespace plan = fsdp::comm::detail::shm_plan;

namespace {

plan::Geometry chunks_of(const std::vector<int64_t>& lens) {
  plan::Geometry g;
  int64_t off = 0;
  for (int64_t len : lens) {
    g.off.push_back(off);
    g.len.push_back(len);
    off += len;
  }
  return g;
}

struct Fragment {
  int chunk;
  int64_t off, len;
  int reader;
  bool operator==(const Fragment& o) const {
    return std::tie(chunk, off, len, reader) == std::tie(o.chunk, o.off, o.len, o.reader);
  }
};

// Addresses compare as addresses (gtest would print a char* as a string).
const void* addr(const char* p) { return p; }

std::vector<Fragment> fragments(const std::vector<plan::FragmentDesc>& lay) {
  std::vector<Fragment> out;
  for (const auto& d : lay) out.push_back({d.chunk, d.off, d.len, d.reader});
  return out;
}

// Every rank's stage of one operation, built as each rank builds it (its own `assigned`
// counts, equal on every rank before the stage).
struct GroupPlan {
  std::vector<plan::Stage> stages;  // by rank
  std::vector<std::vector<uint64_t>> assigned_after;
};

GroupPlan plan_group(bool gather, const std::vector<int64_t>& lens, int64_t slot, const std::vector<uint64_t>& before,
                     std::vector<char>& src, std::vector<char>& dst) {
  const int n = static_cast<int>(lens.size());
  GroupPlan out;
  for (int me = 0; me < n; ++me) {
    plan::StageSpec spec;
    spec.gather = gather;
    spec.me = me;
    spec.n = n;
    spec.geo = chunks_of(lens);
    spec.slot = slot;
    spec.src = src.data();
    spec.dst = dst.data();
    std::vector<uint64_t> assigned = before;
    out.stages.emplace_back();
    plan::build_stage(out.stages.back(), spec, assigned);
    out.assigned_after.push_back(assigned);
  }
  return out;
}

}  // namespace

TEST(ShmRingLayout, GatherCutsTheWritersChunkIntoSlotsForEveryPeer) {
  const auto g = chunks_of({10, 10, 10});
  EXPECT_EQ(fragments(plan::layout(true, 1, 3, g, 4)),
            (std::vector<Fragment>{{1, 0, 4, -1}, {1, 4, 4, -1}, {1, 8, 2, -1}}));
}

TEST(ShmRingLayout, ReduceGoesSegmentBySegmentToEachPeerFromTheNextRankOn) {
  const auto g = chunks_of({10, 10, 10});
  EXPECT_EQ(fragments(plan::layout(false, 0, 3, g, 4)),
            (std::vector<Fragment>{{1, 0, 4, 1}, {2, 0, 4, 2}, {1, 4, 4, 1}, {2, 4, 4, 2}, {1, 8, 2, 1}, {2, 8, 2, 2}}));
  EXPECT_EQ(fragments(plan::layout(false, 1, 3, g, 4)),
            (std::vector<Fragment>{{2, 0, 4, 2}, {0, 0, 4, 0}, {2, 4, 4, 2}, {0, 4, 4, 0}, {2, 8, 2, 2}, {0, 8, 2, 0}}));
}

TEST(ShmRingLayout, ReduceOfUnequalChunksSkipsChunksThatEnded) {
  // All-reduce's near-equal chunks: the last is longer.
  const auto g = chunks_of({3, 3, 4});
  EXPECT_EQ(fragments(plan::layout(false, 0, 3, g, 2)),
            (std::vector<Fragment>{{1, 0, 2, 1}, {2, 0, 2, 2}, {1, 2, 1, 1}, {2, 2, 2, 2}}));
  EXPECT_EQ(fragments(plan::layout(false, 2, 3, g, 2)),
            (std::vector<Fragment>{{0, 0, 2, 0}, {1, 0, 2, 1}, {0, 2, 1, 0}, {1, 2, 1, 1}}));
}

TEST(ShmRingLayout, GatherStageNumbersWritesAfterTheStreamAndReadsEveryPeerInterleaved) {
  std::vector<char> shard(10), flat(30);
  plan::StageSpec spec;
  spec.gather = true;
  spec.me = 1;
  spec.n = 3;
  spec.geo = chunks_of({10, 10, 10});
  spec.slot = 4;
  spec.src = shard.data();
  spec.dst = flat.data();
  std::vector<uint64_t> assigned{5, 0, 2};
  plan::Stage st;
  plan::build_stage(st, spec, assigned);

  ASSERT_EQ(st.writes.size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    const auto& w = st.writes[k];
    EXPECT_EQ(w.fragment, k + 1);
    EXPECT_EQ(w.reader, -1);
    EXPECT_EQ(addr(w.src), addr(shard.data() + 4 * k));
    EXPECT_EQ(w.bytes, k < 2 ? 4 : 2);
    EXPECT_EQ(addr(w.own_dst), addr(flat.data() + 10 + 4 * k));  // our own chunk of the output
    EXPECT_EQ(w.arena_off, -1);
  }
  // Reads by offset, then by writer from the next rank on: 2, 0, 2, 0, 2, 0.
  ASSERT_EQ(st.reads.size(), 6u);
  const std::vector<std::pair<int, uint64_t>> expected{{2, 3}, {0, 6}, {2, 4}, {0, 7}, {2, 5}, {0, 8}};
  for (size_t i = 0; i < 6; ++i) {
    const auto& r = st.reads[i];
    EXPECT_EQ(r.kind, plan::Read::Kind::kCopy);
    ASSERT_EQ(r.fragments.size(), 1u);
    EXPECT_EQ(r.fragments[0], expected[i]) << "read " << i;
    const int w = expected[i].first;
    const int64_t o = 4 * static_cast<int64_t>(i / 2);
    EXPECT_EQ(addr(r.dst), addr(flat.data() + 10 * w + o));
    EXPECT_EQ(r.bytes, o < 8 ? 4 : 2);
  }
  EXPECT_EQ(assigned, (std::vector<uint64_t>{8, 3, 5}));
}

TEST(ShmRingLayout, GatherOfTheOwnChunkCopiesNothingBack) {
  // The shard already is this rank's chunk of the output: no copy into it.
  std::vector<char> flat(24);
  plan::StageSpec spec;
  spec.gather = true;
  spec.me = 2;
  spec.n = 3;
  spec.geo = chunks_of({8, 8, 8});
  spec.slot = 8;
  spec.src = flat.data() + 16;
  spec.dst = flat.data();
  std::vector<uint64_t> assigned(3, 0);
  plan::Stage st;
  plan::build_stage(st, spec, assigned);
  ASSERT_EQ(st.writes.size(), 1u);
  EXPECT_EQ(addr(st.writes[0].own_dst), nullptr);
}

TEST(ShmRingLayout, ReduceReadsTakeEachPeersFragmentForThisRankInRankOrder) {
  std::vector<char> flat(30), out(10);
  plan::StageSpec spec;
  spec.gather = false;
  spec.me = 0;
  spec.n = 3;
  spec.geo = chunks_of({10, 10, 10});
  spec.slot = 4;
  spec.src = flat.data();
  spec.dst = out.data();
  spec.via_temp = true;
  std::vector<uint64_t> assigned{0, 10, 20};
  plan::Stage st;
  plan::build_stage(st, spec, assigned);

  // Writer 1's stream for this stage: (2,0) (0,0) (2,4) (0,4) (2,8) (0,8), so ours are its
  // fragments 2, 4, 6; writer 2's: (0,0) (1,0) ..., so ours are 1, 3, 5.
  ASSERT_EQ(st.reads.size(), 3u);
  for (size_t j = 0; j < 3; ++j) {
    const auto& r = st.reads[j];
    EXPECT_EQ(r.kind, plan::Read::Kind::kReduce);
    EXPECT_EQ(r.fragments, (std::vector<std::pair<int, uint64_t>>{{1, 10 + 2 * j + 2}, {2, 20 + 2 * j + 1}}));
    EXPECT_EQ(addr(r.dst), addr(out.data() + 4 * j));
    EXPECT_EQ(addr(r.own), addr(flat.data() + 4 * j));  // our own row, read in place
    EXPECT_TRUE(r.via_temp);
    EXPECT_EQ(r.bytes, j < 2 ? 4 : 2);
  }
  // Our writes: chunk p of our flat buffer for reader p.
  ASSERT_EQ(st.writes.size(), 6u);
  EXPECT_EQ(addr(st.writes[0].src), addr(flat.data() + 10));
  EXPECT_EQ(st.writes[0].reader, 1);
  EXPECT_EQ(addr(st.writes[1].src), addr(flat.data() + 20));
  EXPECT_EQ(st.writes[1].reader, 2);
  EXPECT_EQ(addr(st.writes[0].own_dst), nullptr);
  EXPECT_EQ(assigned, (std::vector<uint64_t>{6, 16, 26}));
}

TEST(ShmRingLayout, EveryRankReadsExactlyWhatEachWriterWroteForIt) {
  // Across group sizes, chunk shapes and slots: the fragments the readers of a stage take
  // are the writer's fragments, each once by each of its readers, at the same offsets.
  const std::vector<std::vector<int64_t>> shapes{{7, 7}, {5, 5, 5}, {3, 3, 4}, {1, 9, 4, 12}, {0, 2, 2}};
  for (const auto& lens : shapes) {
    for (int64_t slot : {1, 2, 3, 64}) {
      for (bool gather : {true, false}) {
        const int n = static_cast<int>(lens.size());
        std::vector<uint64_t> before(static_cast<size_t>(n));
        for (int w = 0; w < n; ++w) before[w] = 3 * static_cast<uint64_t>(w);
        std::vector<char> src(64), dst(64);
        GroupPlan gp = plan_group(gather, lens, slot, before, src, dst);
        // (writer, fragment) -> readers that took it.
        std::map<std::pair<int, uint64_t>, std::multiset<int>> taken;
        for (int me = 0; me < n; ++me) {
          for (const auto& r : gp.stages[me].reads) {
            for (const auto& f : r.fragments) taken[f].insert(me);
          }
        }
        for (int w = 0; w < n; ++w) {
          const auto& writes = gp.stages[w].writes;
          for (const auto& wr : writes) {
            std::multiset<int> want;
            for (int p = 0; p < n; ++p) {
              if (p != w && (wr.reader < 0 || wr.reader == p)) want.insert(p);
            }
            const auto key = std::make_pair(w, wr.fragment);
            EXPECT_EQ(taken[key], want) << "writer " << w << " fragment " << wr.fragment << " gather " << gather
                                        << " slot " << slot;
            taken.erase(key);
          }
          EXPECT_EQ(gp.assigned_after[0][w], before[w] + writes.size());
        }
        EXPECT_TRUE(taken.empty()) << "reads of fragments nobody wrote";
        for (int me = 1; me < n; ++me) EXPECT_EQ(gp.assigned_after[me], gp.assigned_after[0]);
      }
    }
  }
}

TEST(ShmRingLayout, WritesInTheArenaArePublishedInPlace) {
  std::vector<char> arena(64), elsewhere(30);
  plan::StageSpec spec;
  spec.gather = false;
  spec.me = 1;
  spec.n = 2;
  spec.geo = chunks_of({8, 8});
  spec.slot = 8;
  spec.dst = elsewhere.data();
  spec.arena = {arena.data(), static_cast<int64_t>(arena.size())};
  spec.src = arena.data() + 16;  // the flat buffer lies in the arena
  std::vector<uint64_t> assigned(2, 0);
  plan::Stage in_arena;
  plan::build_stage(in_arena, spec, assigned);
  ASSERT_EQ(in_arena.writes.size(), 1u);
  EXPECT_EQ(in_arena.writes[0].arena_off, 16);  // chunk 0 of the flat buffer, for reader 0

  spec.src = elsewhere.data();
  plan::Stage copied;
  plan::build_stage(copied, spec, assigned);
  ASSERT_EQ(copied.writes.size(), 1u);
  EXPECT_EQ(copied.writes[0].arena_off, -1);
}

TEST(ShmRingLayout, ArenaRangeHoldsOnlyWhatLiesWhollyInside) {
  std::vector<char> buf(100);
  const plan::ArenaRange none{};
  EXPECT_EQ(none.offset_of(buf.data(), 1), -1);
  const plan::ArenaRange r{buf.data() + 10, 50};
  EXPECT_EQ(r.offset_of(buf.data() + 10, 50), 0);
  EXPECT_EQ(r.offset_of(buf.data() + 30, 5), 20);
  EXPECT_EQ(r.offset_of(buf.data() + 5, 10), -1);   // starts before
  EXPECT_EQ(r.offset_of(buf.data() + 55, 10), -1);  // ends after
  EXPECT_EQ(r.offset_of(buf.data() + 20, -1), -1);
}
