// The core's arithmetic and state machines in one process, no ranks: the pieces
// of a padded flat buffer (src/core/flat_param.h) for N ranks against values
// worked out by hand, bucket formation (src/engine/bucket_former.h) against
// hand-made buckets, the gradient division against torch.distributed.fsdp's
// rule, and the unit lifecycle (src/core/unit.h): its transition table against
// the drawing in the header, and one NO_SHARD unit driven through a whole
// iteration with a real backward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <functional>
#include <string>
#include <vector>

// White-box: internal headers of the core.
#include "core/flat_param.h"
#include "core/path_policy.h"
#include "engine/bucket_former.h"
#include "core/resolved_options.h"
#include "core/unit.h"
#include "fsdp/comm/collectives.h"
#include "harness/error_of.h"

using fsdp::testing::error_of;

namespace {

using fsdp::engine::BucketCandidate;
using fsdp::engine::BucketFormer;
using fsdp::core::detail::FlatParameter;
using fsdp::core::detail::FlatParamEntry;
using fsdp::core::detail::FlatState;
using fsdp::core::detail::Unit;
using fsdp::core::detail::UnitState;

// Parameters of the given sizes holding 1, 2, 3, ... across all of them (so the
// value of flat element i is i + 1).
std::vector<FlatParamEntry> entries_of(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<FlatParamEntry> out;
  float next = 1;
  for (size_t i = 0; i < shapes.size(); ++i) {
    FlatParamEntry e;
    e.fqn = "p" + std::to_string(i);
    e.shape = shapes[i];
    e.numel = 1;
    for (auto d : shapes[i]) e.numel *= d;
    e.param = (torch::arange(e.numel, torch::kFloat) + next).view(shapes[i]).clone().set_requires_grad(true);
    next += e.numel;
    out.push_back(std::move(e));
  }
  return out;
}

struct Piece {
  int64_t begin, end;
};

// ---- pieces of the padded flat buffer ----

TEST(FlatPieces, PaddedNumel) {
  EXPECT_EQ(fsdp::comm::padded_numel(15, 4), 16);
  EXPECT_EQ(fsdp::comm::padded_numel(16, 4), 16);
  EXPECT_EQ(fsdp::comm::padded_numel(15, 1), 15);
  EXPECT_EQ(fsdp::comm::padded_numel(1, 3), 3);
  EXPECT_EQ(fsdp::comm::padded_numel(0, 3), 0);
}

// Sizes 5, 3 (as 3x1) and 7 over 4 ranks: 15 elements, padded to 16, chunks of
// 4. p0 = [0,5) spans ranks 0-1, p1 = [5,8) lies in rank 1, p2 = [8,15) spans
// ranks 2-3, and rank 3 holds one element of padding. An empty piece sits at
// the nearest chunk boundary: max(lo, min(offset, hi)).
TEST(FlatPieces, FourRanksByHand) {
  const std::vector<std::vector<Piece>> want = {
      /*rank 0 [0,4)  */ {{0, 4}, {4, 4}, {4, 4}},
      /*rank 1 [4,8)  */ {{4, 5}, {5, 8}, {8, 8}},
      /*rank 2 [8,12) */ {{8, 8}, {8, 8}, {8, 12}},
      /*rank 3 [12,16)*/ {{12, 12}, {12, 12}, {12, 15}},
  };
  for (int rank = 0; rank < 4; ++rank) {
    FlatParameter flat(entries_of({{5}, {3, 1}, {7}}), rank, 4, /*sharded=*/true);
    EXPECT_EQ(flat.total_numel(), 15);
    EXPECT_EQ(flat.padded_numel(), 16);
    EXPECT_EQ(flat.chunk_numel(), 4);
    const auto& e = flat.entries();
    ASSERT_EQ(e.size(), 3u);
    EXPECT_EQ(e[0].offset, 0);
    EXPECT_EQ(e[1].offset, 5);
    EXPECT_EQ(e[2].offset, 8);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(e[i].piece_begin, want[rank][i].begin) << "rank " << rank << " p" << i;
      EXPECT_EQ(e[i].piece_end, want[rank][i].end) << "rank " << rank << " p" << i;
    }
    // The shard holds flat elements [4 rank, 4 rank + 4): values 4 rank + 1 ...,
    // and zero for the padding element 15.
    std::vector<float> shard_want;
    for (int64_t k = 4 * rank; k < 4 * rank + 4; ++k) shard_want.push_back(k < 15 ? float(k + 1) : 0.f);
    EXPECT_TRUE(torch::equal(flat.shard(), torch::tensor(shard_want))) << "rank " << rank << ": " << flat.shard();
    // Outside forward every parameter is its 1-D piece, holding its own values.
    EXPECT_EQ(flat.state(), FlatState::kSharded);
    for (size_t i = 0; i < 3; ++i) {
      const auto& p = e[i].param;
      ASSERT_EQ(p.dim(), 1);
      EXPECT_EQ(p.numel(), want[rank][i].end - want[rank][i].begin);
      if (p.numel() > 0) {
        EXPECT_TRUE(torch::equal(p, torch::arange(want[rank][i].begin, want[rank][i].end, torch::kFloat) + 1))
            << "rank " << rank << " p" << i;
      }
    }
  }
}

// For any N the pieces of one parameter over all ranks tile its span exactly,
// each inside its rank's chunk, and the shards concatenate to the flat buffer.
TEST(FlatPieces, PiecesTileEveryParameter) {
  const std::vector<std::vector<int64_t>> shapes = {{2, 3}, {1}, {11}, {4, 4}, {3}};
  const int64_t total = 6 + 1 + 11 + 16 + 3;
  for (int n : {1, 2, 3, 5, 7, 8, 37, 40}) {
    const int64_t padded = (total + n - 1) / n * n, chunk = padded / n;
    std::vector<at::Tensor> shards;
    std::vector<int64_t> covered(shapes.size(), 0);
    for (int rank = 0; rank < n; ++rank) {
      FlatParameter flat(entries_of(shapes), rank, n, true);
      ASSERT_EQ(flat.padded_numel(), padded) << n;
      ASSERT_EQ(flat.chunk_numel(), chunk) << n;
      int64_t prev_end = rank * chunk;
      for (const auto& e : flat.entries()) {
        EXPECT_LE(rank * chunk, e.piece_begin) << "N=" << n << " rank " << rank << " " << e.fqn;
        EXPECT_LE(e.piece_end, (rank + 1) * chunk);
        EXPECT_LE(e.piece_begin, e.piece_end);
        EXPECT_GE(e.piece_begin, prev_end);  // pieces in order, disjoint
        prev_end = e.piece_end;
        if (e.piece_end > e.piece_begin) {
          EXPECT_GE(e.piece_begin, e.offset);
          EXPECT_LE(e.piece_end, e.offset + e.numel);
        }
      }
      for (size_t i = 0; i < shapes.size(); ++i)
        covered[i] += flat.entries()[i].piece_end - flat.entries()[i].piece_begin;
      shards.push_back(flat.shard());
    }
    for (size_t i = 0; i < shapes.size(); ++i) {
      int64_t numel = 1;
      for (auto d : shapes[i]) numel *= d;
      EXPECT_EQ(covered[i], numel) << "N=" << n << " p" << i;
    }
    auto want = torch::zeros({padded});
    want.narrow(0, 0, total).copy_(torch::arange(total, torch::kFloat) + 1);
    EXPECT_TRUE(torch::equal(torch::cat(shards), want)) << "N=" << n;
  }
}

TEST(FlatPieces, NoShardPiecesAreFullShape) {
  FlatParameter flat(entries_of({{2, 3}, {4}}), /*rank=*/1, /*world=*/4, /*sharded=*/false);
  EXPECT_EQ(flat.padded_numel(), 10);  // world 1: no padding
  EXPECT_EQ(flat.chunk_numel(), 10);
  EXPECT_FALSE(flat.separate_unsharded());
  const auto& e = flat.entries();
  EXPECT_EQ(e[0].param.sizes().vec(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(e[1].param.sizes().vec(), (std::vector<int64_t>{4}));
  EXPECT_TRUE(torch::equal(e[1].param, torch::tensor({7.f, 8.f, 9.f, 10.f})));
}

// ---- bucket formation ----

// Feeds candidates in reduction order, applying BucketFormer::join as
// GradReducer::add does; returns the buckets as lists of positions.
std::vector<std::vector<int>> buckets_of(int64_t cap, const std::vector<BucketCandidate>& units) {
  BucketFormer former(cap);
  std::vector<std::vector<int>> out;
  std::vector<int> open;
  for (int i = 0; i < static_cast<int>(units.size()); ++i) {
    const bool issues = former.issues_on_join(units[i]);
    const auto j = former.join(units[i]);
    EXPECT_EQ(issues, j.close_before || j.close_after) << "unit " << i;
    if (j.close_before) {
      EXPECT_FALSE(open.empty());
      out.push_back(std::move(open));
      open.clear();
    }
    open.push_back(i);
    if (j.close_after) {
      out.push_back(std::move(open));
      open.clear();
    }
  }
  if (!open.empty()) out.push_back(open);  // the end-of-backward callback
  return out;
}

BucketCandidate bytes(int64_t b, bool sharded = true, at::ScalarType dtype = at::kFloat) {
  return BucketCandidate{b, sharded, dtype, at::kCPU};
}

using Buckets = std::vector<std::vector<int>>;

TEST(BucketFormation, CapOffEveryUnitAlone) {
  for (int64_t cap : {0, -1}) {
    EXPECT_EQ(buckets_of(cap, {bytes(10), bytes(1), bytes(1)}), (Buckets{{0}, {1}, {2}})) << cap;
  }
}

TEST(BucketFormation, ConsecutiveUnitsUpToTheCap) {
  // cap 100: 30+30+40 = 100 fits exactly; 50 opens the next; 60 does not fit 50
  // (110 > 100) and opens the next; 20 joins it (80); the rest is left for the end.
  EXPECT_EQ(buckets_of(100, {bytes(30), bytes(30), bytes(40), bytes(50), bytes(60), bytes(20)}),
            (Buckets{{0, 1, 2}, {3}, {4, 5}}));
}

TEST(BucketFormation, UnitAtOrAboveTheCapIsAlone) {
  // 100 >= cap: the open bucket {0} goes first, then 100 alone at once; 150 too.
  EXPECT_EQ(buckets_of(100, {bytes(10), bytes(100), bytes(150), bytes(5), bytes(5)}),
            (Buckets{{0}, {1}, {2}, {3, 4}}));
}

TEST(BucketFormation, KindAndDtypeSplitBuckets) {
  // A NO_SHARD-like (one-row) member never shares with a sharded one, nor a
  // bf16 reduction with an fp32 one, whatever the sizes.
  EXPECT_EQ(buckets_of(1000, {bytes(10), bytes(10, false), bytes(10, false), bytes(10, true, at::kBFloat16),
                              bytes(10, true, at::kBFloat16), bytes(10)}),
            (Buckets{{0}, {1, 2}, {3, 4}, {5}}));
}

// ---- gradient division ----

TEST(GradientDivision, TorchDefaultAndExplicit) {
  // torch.distributed.fsdp: factor = 1; while world % factor == 0 and world / factor > factor: factor *= 2.
  struct Case {
    int world;
    double pre, post;
  };
  for (const Case& c : {Case{1, 1, 1}, Case{2, 2, 1}, Case{3, 2, 1.5}, Case{4, 2, 2}, Case{6, 4, 1.5},
                        Case{8, 4, 2}, Case{16, 4, 4}, Case{32, 8, 4}}) {
    const auto d = fsdp::core::detail::gradient_division(0, c.world);
    EXPECT_DOUBLE_EQ(d.pre, c.pre) << "world " << c.world;
    EXPECT_DOUBLE_EQ(d.post, c.post) << "world " << c.world;
  }
  const auto d = fsdp::core::detail::gradient_division(4, 8);
  EXPECT_DOUBLE_EQ(d.pre, 4);
  EXPECT_DOUBLE_EQ(d.post, 2);
}

// ---- unit lifecycle ----

const std::vector<UnitState> kAllStates = {UnitState::kIdle,     UnitState::kForward,     UnitState::kAwaitBackward,
                                           UnitState::kGatheredForBackward, UnitState::kBackward,
                                           UnitState::kRecompute, UnitState::kReducing, UnitState::kAccumulated, UnitState::kReduced,
                                           UnitState::kStepped};

TEST(UnitLifecycle, TransitionTableMatchesTheDrawing) {
  using S = UnitState;
  // The arrows of [Note: unit lifecycle], written out independently.
  const std::vector<std::pair<S, S>> arrows = {
      {S::kIdle, S::kForward},
      {S::kForward, S::kForward},
      {S::kAwaitBackward, S::kForward},
      {S::kForward, S::kAwaitBackward},
      {S::kForward, S::kIdle},
      {S::kAwaitBackward, S::kIdle},
      {S::kAwaitBackward, S::kGatheredForBackward},
      {S::kAwaitBackward, S::kBackward},
      {S::kGatheredForBackward, S::kBackward},
      {S::kAwaitBackward, S::kReducing},
      {S::kGatheredForBackward, S::kReducing},
      {S::kBackward, S::kReducing},
      {S::kAwaitBackward, S::kAccumulated},
      {S::kGatheredForBackward, S::kAccumulated},
      {S::kBackward, S::kAccumulated},
      {S::kReducing, S::kReduced},
      {S::kReduced, S::kIdle},
      {S::kAccumulated, S::kIdle},
      {S::kGatheredForBackward, S::kIdle},
      {S::kBackward, S::kIdle},
      {S::kIdle, S::kIdle},
      // A recompute inside backward, back to where it came from.
      {S::kAwaitBackward, S::kRecompute},
      {S::kGatheredForBackward, S::kRecompute},
      {S::kBackward, S::kRecompute},
      {S::kRecompute, S::kGatheredForBackward},
      {S::kRecompute, S::kBackward},
      // The optimizer inside backward steps a reduced shard.
      {S::kReduced, S::kStepped},
      {S::kStepped, S::kIdle},
  };
  int allowed = 0;
  for (S from : kAllStates) {
    for (S to : kAllStates) {
      bool want = false;
      for (const auto& a : arrows) want = want || (a.first == from && a.second == to);
      EXPECT_EQ(fsdp::core::detail::unit_transition_allowed(from, to), want)
          << fsdp::core::detail::to_string(from) << " -> " << fsdp::core::detail::to_string(to);
      allowed += want;
    }
  }
  EXPECT_EQ(allowed, static_cast<int>(arrows.size()));
}

class NoOpGradHook : public torch::autograd::FunctionPostHook {
 public:
  explicit NoOpGradHook(std::vector<size_t>* fired, size_t entry) : fired_(fired), entry_(entry) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fired_->push_back(entry_);
    return outputs;
  }

 private:
  std::vector<size_t>* fired_;
  size_t entry_;
};

// Blocks from a block allocator (the exchange arena) are kept whatever their size:
// the arena punches a freed block's pages out, so freeing a small one every step
// cost syscalls and page faults. Small blocks of the CPU allocator are not kept.
TEST(BufferPool, KeepsSmallBlocksOfABlockAllocatorOnly) {
  int blocks = 0;
  fsdp::memory::BufferPool arena_like{4, 1 << 20};
  arena_like.set_block_allocator([&](size_t n) {
    ++blocks;
    return c10::GetAllocator(c10::DeviceType::CPU)->allocate(n);
  });
  for (int i = 0; i < 3; ++i) arena_like.allocate(41000);  // each freed at once
  EXPECT_EQ(blocks, 1);
  EXPECT_EQ(arena_like.idle_bytes(), 41000);

  fsdp::memory::BufferPool cpu{4, 1 << 20};
  cpu.allocate(41000);
  EXPECT_EQ(cpu.idle_bytes(), 0);  // glibc reuses it from its heap
  cpu.allocate(2 << 20);
  EXPECT_EQ(cpu.idle_bytes(), 2 << 20);
}

// Every new block, and only new ones, goes to the observer (the stream order forgets the
// address's history and a GPU backend names the block to the caching allocator); a block
// kept idle serves a request of its own device only.
TEST(BufferPool, TellsTheObserverOfNewBlocksOnly) {
  fsdp::memory::BufferPool pool{4, 0};
  std::vector<const void*> seen;
  pool.set_new_block_observer([&](const at::DataPtr& b) { seen.push_back(b.get()); });
  const void* first = nullptr;
  {
    at::DataPtr a = pool.allocate(4096);
    first = a.get();
    EXPECT_EQ(a.device(), at::Device(at::kCPU));
  }
  { at::DataPtr again = pool.allocate(4096); EXPECT_EQ(again.get(), first); }  // the idle block
  at::DataPtr big = pool.allocate(1 << 20);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], first);
  EXPECT_EQ(seen[1], big.get());
  const at::Tensor t = pool.empty(16, at::TensorOptions().dtype(at::kFloat));
  EXPECT_EQ(t.numel(), 16);
  EXPECT_TRUE(t.device().is_cpu());
}

// Device times ([Note: device placement] traces): spans opened with a device stream carry
// the times of the events their clock recorded, read only when the trace is; a collective's
// device end is the one marked right after its issue, not the later end of its host span.
struct FakeClock : fsdp::DeviceClock {
  int64_t now = 1000;
  std::vector<int> tids;
  std::shared_ptr<void> mark(int tid) override {
    tids.push_back(tid);
    return std::make_shared<int64_t>(now += 10);
  }
  int64_t time_us(const std::shared_ptr<void>& e) override { return *static_cast<int64_t*>(e.get()); }
};

TEST(Tracer, DeviceTimesComeFromTheClock) {
  fsdp::Tracer tracer{::testing::TempDir() + "/fsdp_device_trace", 0};
  auto clock = std::make_shared<FakeClock>();
  tracer.set_device_clock(clock);
  auto gather = tracer.begin(fsdp::Tracer::kGather);  // event at 1010
  tracer.end_on_device(gather);                        // 1020, at the issue
  auto forward = tracer.begin(fsdp::Tracer::kCompute); // 1030
  clock->now = 5000;
  tracer.end("all_gather l1", fsdp::Tracer::kGather, gather);  // no new event
  tracer.end("forward l1", fsdp::Tracer::kCompute, forward);   // 5010
  auto host_only = tracer.begin();
  tracer.end("reduce l1", fsdp::Tracer::kReduce, host_only);
  EXPECT_EQ(clock->tids, (std::vector<int>{1, 1, 0, 0}));
  const auto spans = tracer.spans();
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0].device_begin_us, 1010);
  EXPECT_EQ(spans[0].device_end_us, 1020);
  EXPECT_EQ(spans[1].device_begin_us, 1030);
  EXPECT_EQ(spans[1].device_end_us, 5010);
  EXPECT_EQ(spans[2].device_begin_us, -1);
  const std::string path = tracer.flush();
  std::ifstream in(path);
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(json.find("\"tid\":11,\"ts\":1010,\"dur\":10"), std::string::npos) << json;
  EXPECT_NE(json.find("\"tid\":10,\"ts\":1030,\"dur\":3980"), std::string::npos) << json;
  EXPECT_NE(json.find("\"name\":\"device: all_gather\""), std::string::npos) << json;
  EXPECT_EQ(json.find("\"tid\":12,\"ts\""), std::string::npos) << "the host-only span has no device event";
}

struct UnitFixture {
  fsdp::memory::BufferPool pool{4, 1024};
  fsdp::Tracer tracer{"", 0};  // disabled
  std::unique_ptr<Unit> unit;
  explicit UnitFixture(fsdp::core::detail::GradientDivision divide = {}) {
    fsdp::core::detail::UnitContext ctx;
    ctx.rank = 3;
    ctx.pool = &pool;
    ctx.tracer = &tracer;
    ctx.divide = divide;
    // NO_SHARD, full precision: nothing is ever gathered, so no process group is needed.
    auto flat = std::make_unique<FlatParameter>(entries_of({{2, 2}, {3}}), 0, 1, /*sharded=*/false);
    unit = std::make_unique<Unit>(std::move(ctx), 1, "blocks.1", std::move(flat), /*is_root=*/false, false);
  }
};

TEST(UnitLifecycle, RefusedTransitionsNameUnitAndBothStates) {
  UnitFixture fx;
  Unit& u = *fx.unit;
  ASSERT_EQ(u.state(), UnitState::kIdle);
  std::string msg = error_of([&] { u.begin_backward(); });
  EXPECT_NE(msg.find("unit 'blocks.1' on rank 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("from IDLE to BACKWARD"), std::string::npos) << msg;
  EXPECT_EQ(u.state(), UnitState::kIdle);  // refused: nothing changed

  msg = error_of([&] { u.adopt_reduced_shard(torch::zeros({7})); });
  EXPECT_NE(msg.find("from IDLE to REDUCED"), std::string::npos) << msg;
  msg = error_of([&] { u.end_forward(true, false); });
  EXPECT_NE(msg.find("post_forward in state IDLE, expected FORWARD"), std::string::npos) << msg;

  std::vector<size_t> fired;
  auto hook = [&](size_t i) { return std::make_unique<NoOpGradHook>(&fired, i); };
  u.begin_forward(true, hook);
  u.end_forward(true, false);
  ASSERT_EQ(u.state(), UnitState::kAwaitBackward);
  msg = error_of([&] { u.adopt_reduced_shard(torch::zeros({7})); });
  EXPECT_NE(msg.find("from AWAIT_BACKWARD to REDUCED"), std::string::npos) << msg;
  u.abandon_forward();
  EXPECT_EQ(u.state(), UnitState::kIdle);
}

// A recompute returns to the backward state it came from, and refuses to start outside
// backward or to end twice.
TEST(UnitLifecycle, RecomputeReturnsWhereItCameFrom) {
  UnitFixture fx;
  Unit& u = *fx.unit;
  std::vector<size_t> fired;
  auto hook = [&](size_t i) { return std::make_unique<NoOpGradHook>(&fired, i); };
  std::string msg = error_of([&] { u.begin_recompute(hook); });
  EXPECT_NE(msg.find("from IDLE to RECOMPUTE"), std::string::npos) << msg;
  {
    torch::NoGradGuard checkpointed_forward;
    u.begin_forward(/*training=*/true, hook);
    u.end_forward(true, false);
  }
  ASSERT_EQ(u.state(), UnitState::kAwaitBackward);
  u.begin_recompute(hook);
  EXPECT_EQ(u.state(), UnitState::kRecompute);
  EXPECT_EQ(u.flat().state(), FlatState::kUnsharded);
  u.end_recompute();
  EXPECT_EQ(u.state(), UnitState::kGatheredForBackward);
  msg = error_of([&] { u.end_recompute(); });
  EXPECT_NE(msg.find("post_forward of a recompute in state GATHERED_FOR_BACKWARD, expected RECOMPUTE"),
            std::string::npos) << msg;
  u.begin_backward();
  u.begin_recompute(hook);
  u.end_recompute();
  EXPECT_EQ(u.state(), UnitState::kBackward);
  u.finish_iteration();
  EXPECT_EQ(u.state(), UnitState::kIdle);
}

// One iteration of a NO_SHARD unit with a real backward: loss = sum(p0 * x0) +
// sum(p1 * x1), so each gradient is its x, divided by pre * post = 2 * 1.5.
TEST(UnitLifecycle, WholeIterationWithRealGradients) {
  UnitFixture fx(fsdp::core::detail::GradientDivision{2, 1.5});
  Unit& u = *fx.unit;
  auto& e = u.flat().entries();
  std::vector<size_t> fired;
  auto hook = [&](size_t i) { return std::make_unique<NoOpGradHook>(&fired, i); };

  u.begin_forward(/*training=*/true, hook);
  EXPECT_EQ(u.state(), UnitState::kForward);
  EXPECT_EQ(u.flat().state(), FlatState::kUnsharded);
  const auto x0 = torch::arange(4, torch::kFloat).view({2, 2}) + 1, x1 = torch::tensor({-3.f, 6.f, 9.f});
  auto loss = (e[0].param * x0).sum() + (e[1].param * x1).sum();
  u.end_forward(true, false);
  EXPECT_EQ(u.state(), UnitState::kAwaitBackward);

  u.stash_grads();
  u.begin_backward();
  EXPECT_EQ(u.state(), UnitState::kBackward);
  loss.backward();
  std::sort(fired.begin(), fired.end());
  EXPECT_EQ(fired, (std::vector<size_t>{0, 1}));  // the installed AccumulateGrad hooks ran
  EXPECT_FALSE(u.note_param_grad(0));
  EXPECT_TRUE(u.note_param_grad(1));  // the unit's gradients are complete
  EXPECT_FALSE(u.note_param_grad(1));  // counted once

  u.flatten_grads(/*no_sync=*/false);
  EXPECT_EQ(u.state(), UnitState::kReducing);
  at::Tensor flat = u.take_flat_grad();
  ASSERT_EQ(flat.numel(), 7);
  EXPECT_TRUE(torch::allclose(flat, torch::cat({x0.flatten(), x1}) / 2));  // pre-divided
  u.adopt_reduced_shard(flat);  // a world of one: the reduction is the identity
  EXPECT_EQ(u.state(), UnitState::kReduced);
  u.finish_iteration();
  EXPECT_EQ(u.state(), UnitState::kIdle);
  EXPECT_TRUE(torch::allclose(e[0].param.grad(), x0 / 3));
  EXPECT_TRUE(torch::allclose(e[1].param.grad(), x1 / 3));

  // Another whole iteration, its reduction the identity as above.
  auto iterate = [&] {
    u.begin_forward(true, hook);
    auto l = (e[0].param * x0).sum() + (e[1].param * x1).sum();
    u.end_forward(true, false);
    u.stash_grads();
    u.begin_backward();
    l.backward();
    u.flatten_grads(false);
    u.adopt_reduced_shard(u.take_flat_grad());
    u.finish_iteration();
  };
  // A second iteration accumulates onto the first's gradient pieces.
  iterate();
  EXPECT_TRUE(torch::allclose(e[0].param.grad(), 2 * x0 / 3));
  EXPECT_TRUE(torch::allclose(e[1].param.grad(), 2 * x1 / 3));

  // A third after the user zeroed one piece and left a single nonzero element, the
  // last, in the other: the zeroed piece is this iteration's gradient alone, bit for
  // bit (skipped, not added), the other still has its element added.
  const at::Tensor first0 = x0 / 2 / 1.5;  // the first iteration's computation
  e[0].param.mutable_grad().zero_();
  e[1].param.mutable_grad().zero_();
  e[1].param.mutable_grad()[2] = 5;
  iterate();
  EXPECT_TRUE(torch::equal(e[0].param.grad(), first0));
  EXPECT_TRUE(torch::allclose(e[1].param.grad(), x1 / 3 + torch::tensor({0.f, 0.f, 5.f})));
}

TEST(UnitLifecycle, NoSyncAccumulatesWithoutReduction) {
  UnitFixture fx;
  Unit& u = *fx.unit;
  auto& e = u.flat().entries();
  std::vector<size_t> fired;
  auto hook = [&](size_t i) { return std::make_unique<NoOpGradHook>(&fired, i); };
  u.begin_forward(true, hook);
  auto loss = (e[0].param * 2).sum() + e[1].param.sum();
  u.end_forward(true, false);
  u.stash_grads();
  u.begin_backward();
  loss.backward();
  u.flatten_grads(/*no_sync=*/true);
  EXPECT_EQ(u.state(), UnitState::kAccumulated);
  EXPECT_FALSE(u.flat_grad().defined());
  EXPECT_EQ(u.transient_bytes(), 7 * 4);  // the accumulated unsharded gradient
  u.finish_iteration();
  EXPECT_EQ(u.state(), UnitState::kIdle);
  EXPECT_FALSE(e[0].param.grad().defined());  // nothing reduced yet, nothing assigned
}

}  // namespace

// path_policy's patterns: `*` takes any characters of one component, never a '.'.
TEST(PathPolicy, PatternsMatchWithinAComponent) {
  using fsdp::core::detail::path_matches;
  EXPECT_TRUE(path_matches("blocks.3", "blocks.3"));
  EXPECT_FALSE(path_matches("blocks.3", "blocks.30"));
  EXPECT_TRUE(path_matches("blocks.*", "blocks.30"));
  EXPECT_FALSE(path_matches("blocks.*", "blocks.3.attn"));
  EXPECT_TRUE(path_matches("h.*.mlp", "h.11.mlp"));
  EXPECT_FALSE(path_matches("h.*.mlp", "h.1.attn.mlp"));
  EXPECT_TRUE(path_matches("block*", "block0"));
  EXPECT_TRUE(path_matches("*", "head"));
  EXPECT_FALSE(path_matches("*", "head.0"));
  EXPECT_TRUE(path_matches("*.*", "head.0"));
  EXPECT_TRUE(path_matches("a*b*c", "axxbyyc"));
  EXPECT_FALSE(path_matches("a*c", "ab.c"));
  EXPECT_FALSE(path_matches("", "a"));
}
