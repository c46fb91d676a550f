// Collectives at world sizes 1-4 against values computed by hand, including flat
// buffers that need padding, the bytes each op reports, and sub-groups.
#include <cmath>
#include <thread>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <ATen/CPUGeneratorImpl.h>

#include "comm/comm_testing.h"
#include "fsdp/comm/collectives.h"
#include "harness/multirank.h"
#include "comm/kernels/row_sum_kernel.h"

using namespace fsdp;
using fsdp::testing::run_case;
using fsdp::testing::run_ranks;

namespace {

// Element i of rank r's input: a value no two (rank, index) pairs share, so a
// misplaced chunk cannot go unnoticed.
torch::Tensor rank_values(int64_t numel, int rank, torch::Dtype dtype = torch::kFloat) {
  return (torch::arange(numel, torch::kDouble) + 1000.0 * (rank + 1)).to(dtype);
}

// Rank q's reduce-scatter input in the segment tests: random floats (seeded by q) so
// that the float sum depends on the order of addition.
torch::Tensor random_flat(int64_t numel, int q, torch::Dtype dtype = torch::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + q);
  return at::randn({numel}, gen, torch::TensorOptions().dtype(torch::kFloat)).to(dtype);
}

// The reference reduce-scatter computed locally from every rank's input: chunk r of
// sum_q flat_q, added in rank order (so float results compare bit for bit).
torch::Tensor reference_chunk(int64_t chunk, int n, int r, torch::Dtype dtype = torch::kFloat) {
  torch::Tensor acc;
  for (int q = 0; q < n; ++q) {
    auto part = random_flat(chunk * n, q, dtype).slice(0, r * chunk, (r + 1) * chunk);
    acc = q == 0 ? part.clone() : acc + part;
  }
  return acc;
}

// Segmenting, buffer reuse and calls in flight on several groups.
void pipeline_cases(comm::ProcessGroup& pg) {
  const int n = pg.size();
  const int r = pg.rank();
  const int64_t default_segment = comm::comm_segment_bytes();
  EXPECT_EQ(default_segment, int64_t(4) << 20);

  const int64_t default_alltoall = comm::comm_alltoall_max_bytes();
  EXPECT_EQ(default_alltoall, int64_t(2) << 20);
  // These small buffers take the alltoall path at N >= 3 by default; first over
  // send/recv (alltoall off), then by default.
  for (int64_t alltoall_max : {int64_t(0), default_alltoall}) {
  comm::set_comm_alltoall_max_bytes(alltoall_max);
  const std::string path = alltoall_max == 0 ? " (send/recv)" : " (default path)";
  // 16-element segments: chunks just below, at and above one segment, and many.
  comm::set_comm_segment_bytes(64);
  for (int64_t chunk : {1, 15, 16, 17, 31, 32, 33, 16 * 37 + 5}) {
    run_case("reduce_scatter segments chunk=" + std::to_string(chunk) + path, [&] {
      auto flat = random_flat(chunk * n, r);
      auto out = torch::full({chunk}, -1.0f);
      comm::reduce_scatter(pg, out, flat).wait();
      EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r))) << "chunk " << chunk;
      auto avg = torch::empty({chunk}, torch::kDouble);
      comm::reduce_scatter(pg, avg, random_flat(chunk * n, r, torch::kDouble), comm::ReduceOp::kAvg)
          .wait();
      EXPECT_TRUE(torch::equal(avg, reference_chunk(chunk, n, r, torch::kDouble) / n));
      // bf16 travels as bytes (see [Note: bf16 over Gloo]) and sums in bf16, rank order.
      auto low = torch::empty({chunk}, torch::kBFloat16);
      comm::reduce_scatter(pg, low, random_flat(chunk * n, r, torch::kBFloat16)).wait();
      EXPECT_TRUE(torch::equal(low, reference_chunk(chunk, n, r, torch::kBFloat16)));
      auto low_flat = torch::zeros({chunk * n}, torch::kBFloat16);
      comm::all_gather_into(pg, low_flat, rank_values(chunk, r).to(torch::kBFloat16)).wait();
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(torch::equal(low_flat.slice(0, q * chunk, (q + 1) * chunk),
                                 rank_values(chunk, q).to(torch::kBFloat16)));
      }
      auto gathered = torch::full({chunk * n}, -1.0f);
      comm::comm_counters().reset();
      comm::all_gather_into(pg, gathered, rank_values(chunk, r)).wait();
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(torch::equal(gathered.slice(0, q * chunk, (q + 1) * chunk), rank_values(chunk, q)))
            << "chunk of rank " << q;
      }
      EXPECT_EQ(comm::comm_counters().all_gather.load(), 4 * chunk * (n - 1));
      // The shard may be this rank's own chunk of the flat buffer (in-place gather).
      auto inplace = torch::full({chunk * n}, -1.0f);
      inplace.slice(0, r * chunk, (r + 1) * chunk).copy_(rank_values(chunk, r));
      comm::all_gather_into(pg, inplace, inplace.slice(0, r * chunk, (r + 1) * chunk)).wait();
      EXPECT_TRUE(torch::equal(inplace, gathered));
    });
  }
  run_case("reduce_scatter output aliasing the flat buffer" + path, [&] {
    const int64_t chunk = 16 * 3 + 1;
    // Our own chunk of the flat buffer, then another rank's chunk.
    for (int target : {r, (r + 1) % n}) {
      auto flat = random_flat(chunk * n, r);
      auto out = flat.slice(0, target * chunk, (target + 1) * chunk);
      comm::reduce_scatter(pg, out, flat).wait();
      EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r))) << "target chunk " << target;
    }
  });
  // A segment size that is not a multiple of the element size rounds down.
  comm::set_comm_segment_bytes(70);
  run_case("reduce_scatter segment of 70 bytes" + path, [&] {
    const int64_t chunk = 100;
    auto out = torch::empty({chunk});
    comm::reduce_scatter(pg, out, random_flat(chunk * n, r)).wait();
    EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r)));
  });
  comm::set_comm_segment_bytes(default_segment);
  }
  comm::set_comm_alltoall_max_bytes(default_alltoall);
  EXPECT_THROW(comm::set_comm_segment_bytes(0), c10::Error);
  EXPECT_THROW(comm::set_comm_alltoall_max_bytes(-1), c10::Error);

  run_case("default segment: one element either side of 4 MiB per chunk", [&] {
    for (int64_t chunk : {(int64_t(1) << 20) - 1, (int64_t(1) << 20) + 1}) {
      auto out = torch::empty({chunk});
      comm::comm_counters().reset();
      comm::reduce_scatter(pg, out, random_flat(chunk * n, r)).wait();
      EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r))) << "chunk " << chunk;
      EXPECT_EQ(comm::comm_counters().reduce_scatter.load(), 4 * chunk * (n - 1));
      auto flat = torch::full({chunk * n}, -1.0f);
      comm::all_gather_into(pg, flat, rank_values(chunk, r)).wait();
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(torch::equal(flat.slice(0, q * chunk, (q + 1) * chunk), rank_values(chunk, q)));
      }
    }
  });

  if (n < 2) return;  // below: sub-groups and buffers kept by them
  std::vector<int> all(n);
  for (int q = 0; q < n; ++q) all[q] = q;

  run_case("back-to-back calls of different sizes reuse the receive buffer", [&] {
    auto g = pg.new_subgroup(all);  // a group with no buffer yet
    // Flat buffers of ~8n/(n-1) MiB: send/recv, receive buffers of (n-1)*chunk floats
    // (1 MiB and more are kept by the group).
    const int64_t big = (int64_t(2) << 20) / (n - 1) + 7;
    comm::set_comm_segment_bytes(int64_t(1) << 20);
    const int64_t before = comm::comm_cached_bytes();
    for (int64_t chunk : {big, big / 2 + 3, int64_t(5), big + 1000, big}) {
      auto out = torch::empty({chunk});
      comm::reduce_scatter(g, out, random_flat(chunk * n, r)).wait();
      EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r))) << "chunk " << chunk;
    }
    // One idle buffer, the largest: (n-1)*(big+1000) floats.
    EXPECT_EQ(comm::comm_cached_bytes() - before, 4 * (n - 1) * (big + 1000));
    comm::set_comm_segment_bytes(default_segment);
  });

  run_case("the small-buffer path at its threshold, and the buffer it keeps", [&] {
    // What the group keeps tells the path: alltoall leases a scratch of twice n rows (what
    // goes, what comes), each a chunk behind a 64-byte header; send/recv a receive buffer of
    // (n-1)/n of the flat size (all-gather none).
    const int64_t limit = comm::comm_alltoall_max_bytes();
    for (int64_t chunk : {limit / 4 / n, limit / 4 / n + 1}) {
      const bool small = n > 2 && 4 * n * chunk <= limit;
      const int64_t kept = small ? 2 * n * (64 + 4 * chunk) : 4 * chunk * (n - 1);
      auto g = pg.new_subgroup(all);
      const int64_t before = comm::comm_cached_bytes();
      auto out = torch::empty({chunk});
      comm::reduce_scatter(g, out, random_flat(chunk * n, r)).wait();
      EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r))) << "chunk " << chunk;
      EXPECT_EQ(comm::comm_cached_bytes() - before, kept) << "chunk " << chunk;
      auto avg = torch::empty({chunk});
      comm::reduce_scatter(g, avg, random_flat(chunk * n, r), comm::ReduceOp::kAvg).wait();
      EXPECT_TRUE(torch::equal(avg, reference_chunk(chunk, n, r) / n));
      // All-gather, also in place; the scratch it leases is the same size (or none).
      auto flat = torch::full({chunk * n}, -1.0f);
      flat.slice(0, r * chunk, (r + 1) * chunk).copy_(rank_values(chunk, r));
      comm::comm_counters().reset();
      comm::all_gather_into(g, flat, flat.slice(0, r * chunk, (r + 1) * chunk)).wait();
      EXPECT_EQ(comm::comm_counters().all_gather.load(), 4 * chunk * (n - 1));
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(torch::equal(flat.slice(0, q * chunk, (q + 1) * chunk), rank_values(chunk, q)));
      }
      EXPECT_EQ(comm::comm_cached_bytes() - before, kept);
    }
  });

  run_case("collectives in flight on two groups and twice on one", [&] {
    auto g1 = pg.new_subgroup(all);
    auto g2 = pg.new_subgroup(all);
    const int64_t before = comm::comm_cached_bytes();
    {
      const int64_t big = (int64_t(2) << 20) / (n - 1) + 1;
      comm::set_comm_segment_bytes(int64_t(1) << 20);
      auto f1 = random_flat(big * n, r), f2 = random_flat(big * n, r);
      auto o1 = torch::empty({big}), o2 = torch::empty({big}), o3 = torch::empty({big});
      auto gathered = torch::full({big * n}, -1.0f);
      // Two large reduce-scatters on g1 (the second finds no idle buffer), one on g2,
      // and an all-gather on g2, waited in an order different from the issue order.
      auto h1 = comm::reduce_scatter(g1, o1, f1);
      auto h2 = comm::reduce_scatter(g2, o2, f2);
      auto h3 = comm::all_gather_into(g2, gathered, rank_values(big, r));
      auto h4 = comm::reduce_scatter(g1, o3, f1.clone());
      h4.wait();
      h2.wait();
      h3.wait();
      h1.wait();
      auto expected = reference_chunk(big, n, r);
      EXPECT_TRUE(torch::equal(o1, expected));
      EXPECT_TRUE(torch::equal(o2, expected));
      EXPECT_TRUE(torch::equal(o3, expected));
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(torch::equal(gathered.slice(0, q * big, (q + 1) * big), rank_values(big, q)));
      }
      comm::set_comm_segment_bytes(default_segment);
      EXPECT_EQ(comm::comm_cached_bytes() - before, 2 * 4 * (n - 1) * big);
    }
    // Groups gone: their buffers go with them (noticed on the next call).
    g1 = comm::ProcessGroup();
    g2 = comm::ProcessGroup();
    auto t = torch::ones({n});
    comm::reduce_scatter(pg, t.slice(0, r, r + 1).clone(), t).wait();
    EXPECT_EQ(comm::comm_cached_bytes(), before);
  });
}

// The shared-memory transport's own geometry: chunks around one slot (256 KiB) and
// larger than the whole ring (16 slots), all-reduce chunks of zero elements, every
// reduction, and operations in flight on several groups waited out of order.
void shm_cases(comm::ProcessGroup& pg) {
  const int n = pg.size();
  const int r = pg.rank();
  if (n < 2) return;
  run_case("shm: a same-host group has a channel", [&] { EXPECT_NE(pg.shm_channel(), nullptr); });
  const int64_t slot = 65536;  // floats in one 256 KiB slot
  for (int64_t chunk : {slot - 1, slot, slot + 1, 20 * slot + 3}) {
    run_case("shm: reduce_scatter and all_gather chunk=" + std::to_string(chunk), [&] {
      auto out = torch::full({chunk}, -1.0f);
      comm::comm_counters().reset();
      comm::reduce_scatter(pg, out, random_flat(chunk * n, r)).wait();
      EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r)));
      EXPECT_EQ(comm::comm_counters().reduce_scatter.load(), 4 * chunk * (n - 1));
      auto avg = torch::empty({chunk}, torch::kDouble);
      comm::reduce_scatter(pg, avg, random_flat(chunk * n, r, torch::kDouble), comm::ReduceOp::kAvg).wait();
      EXPECT_TRUE(torch::equal(avg, reference_chunk(chunk, n, r, torch::kDouble) / n));
      auto low = torch::empty({chunk}, torch::kBFloat16);
      comm::reduce_scatter(pg, low, random_flat(chunk * n, r, torch::kBFloat16)).wait();
      EXPECT_TRUE(torch::equal(low, reference_chunk(chunk, n, r, torch::kBFloat16)));
      auto flat = torch::full({chunk * n}, -1.0f);
      comm::all_gather_into(pg, flat, rank_values(chunk, r)).wait();
      auto inplace = torch::full({chunk * n}, -1.0f);
      inplace.slice(0, r * chunk, (r + 1) * chunk).copy_(rank_values(chunk, r));
      comm::all_gather_into(pg, inplace, inplace.slice(0, r * chunk, (r + 1) * chunk)).wait();
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(torch::equal(flat.slice(0, q * chunk, (q + 1) * chunk), rank_values(chunk, q))) << q;
      }
      EXPECT_TRUE(torch::equal(inplace, flat));
    });
  }
  run_case("shm: reduce_scatter output aliasing the flat buffer", [&] {
    const int64_t chunk = 2 * slot + 3;
    for (int target : {r, (r + 1) % n}) {
      auto flat = random_flat(chunk * n, r);
      auto out = flat.slice(0, target * chunk, (target + 1) * chunk);
      comm::reduce_scatter(pg, out, flat).wait();
      EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r))) << "target chunk " << target;
    }
  });
  run_case("shm: all_reduce in rank order, every reduction", [&] {
    for (int64_t numel : {int64_t(1), int64_t(n - 1), int64_t(7), 3 * slot + 5, 40 * slot + 1}) {
      // Reference: the inputs of all ranks added in rank order, element by element.
      auto sum = random_flat(numel, 0), mx = random_flat(numel, 0);
      auto sum_d = random_flat(numel, 0, torch::kDouble);
      for (int q = 1; q < n; ++q) {
        sum = sum + random_flat(numel, q);
        sum_d = sum_d + random_flat(numel, q, torch::kDouble);
        mx = torch::maximum(mx, random_flat(numel, q));
      }
      comm::comm_counters().reset();
      auto t = random_flat(numel, r);
      comm::all_reduce(pg, t).wait();
      EXPECT_TRUE(torch::equal(t, sum)) << "numel " << numel;
      EXPECT_EQ(comm::comm_counters().all_reduce.load(), 2 * 4 * numel * (n - 1) / n);
      auto d = random_flat(numel, r, torch::kDouble);
      comm::all_reduce(pg, d, comm::ReduceOp::kAvg).wait();
      EXPECT_TRUE(torch::equal(d, sum_d / n)) << "numel " << numel;
      auto m = random_flat(numel, r);
      comm::all_reduce(pg, m, comm::ReduceOp::kMax).wait();
      EXPECT_TRUE(torch::equal(m, mx)) << "numel " << numel;
      auto i = torch::full({numel}, int64_t(r + 1), torch::kLong);
      comm::all_reduce(pg, i).wait();
      EXPECT_TRUE(torch::equal(i, torch::full({numel}, int64_t(n * (n + 1) / 2), torch::kLong)));
    }
  });
  run_case("shm: slot bytes written, counted where the copies happen", [&] {
    // What this rank writes into its ring, in closed form: the shard once (every peer reads
    // it), chunk p of the flat buffer for each peer p, and for all-reduce the tensor once
    // (its peers' chunks in the reduce-scatter stage, its own reduced chunk in the
    // all-gather stage).
    const int64_t chunk = 3 * slot + 7, numel = 5 * slot + 3;
    comm::shm_slot_counters().reset();
    comm::shm_in_place_counters().reset();
    auto flat = torch::empty({chunk * n});
    comm::all_gather_into(pg, flat, rank_values(chunk, r)).wait();
    auto out = torch::empty({chunk});
    comm::reduce_scatter(pg, out, random_flat(chunk * n, r)).wait();
    auto t = random_flat(numel, r);
    comm::all_reduce(pg, t).wait();
    EXPECT_EQ(comm::shm_slot_counters().all_gather.load(), 4 * chunk);
    EXPECT_EQ(comm::shm_slot_counters().reduce_scatter.load(), 4 * chunk * (n - 1));
    EXPECT_EQ(comm::shm_slot_counters().all_reduce.load(), 4 * numel);
    EXPECT_EQ(comm::shm_slot_counters().broadcast.load(), 0);
    EXPECT_EQ(comm::shm_in_place_counters().total(), 0);  // ordinary tensors: copied into the slots
    // Over Gloo nothing goes through the slots.
    comm::set_comm_shared_memory(false);
    comm::shm_slot_counters().reset();
    comm::all_reduce(pg, t).wait();
    comm::all_gather_into(pg, flat, rank_values(chunk, r)).wait();
    comm::set_comm_shared_memory(true);
    EXPECT_EQ(comm::shm_slot_counters().total(), 0);
  });
  run_case("shm: buffers in the exchange arena are read in place, and held until read", [&] {
    // A flat buffer from allocate_collective_buffer lies in this rank's exchange arena:
    // peers copy (or sum) straight from it, so nothing goes through the slots, with the
    // same results as the copying path. Sizes cross the ring (16 slots).
    auto arena_tensor = [&](int64_t numel) {
      const size_t nbytes = static_cast<size_t>(numel) * sizeof(float);
      c10::Storage st(c10::Storage::use_byte_size_t(), nbytes, comm::allocate_collective_buffer(pg, nbytes),
                      /*allocator=*/nullptr, /*resizable=*/false);
      return torch::empty({0}).set_(st, 0, {numel}, {1});
    };
    for (int64_t chunk : {slot - 1, 20 * slot + 3}) {
      comm::shm_slot_counters().reset();
      comm::shm_in_place_counters().reset();
      auto flat = arena_tensor(chunk * n);
      flat.fill_(-1.0f);
      comm::all_gather_into(pg, flat, rank_values(chunk, r)).wait();
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(torch::equal(flat.slice(0, q * chunk, (q + 1) * chunk), rank_values(chunk, q))) << q;
      }
      auto src = arena_tensor(chunk * n);
      src.copy_(random_flat(chunk * n, r));
      auto out = torch::full({chunk}, -1.0f);
      comm::reduce_scatter(pg, out, src).wait();
      EXPECT_TRUE(torch::equal(out, reference_chunk(chunk, n, r))) << "chunk " << chunk;
      auto t = arena_tensor(chunk);
      t.copy_(random_flat(chunk, r));
      auto sum = random_flat(chunk, 0);
      for (int q = 1; q < n; ++q) sum = sum + random_flat(chunk, q);
      comm::all_reduce(pg, t).wait();
      EXPECT_TRUE(torch::equal(t, sum)) << "chunk " << chunk;
      // Published as much as the copying path would, all of it in place.
      EXPECT_EQ(comm::shm_slot_counters().all_gather.load(), 4 * chunk);
      EXPECT_EQ(comm::shm_slot_counters().reduce_scatter.load(), 4 * chunk * (n - 1));
      EXPECT_EQ(comm::shm_slot_counters().all_reduce.load(), 4 * chunk);
      EXPECT_EQ(comm::shm_in_place_counters().total(), comm::shm_slot_counters().total())
          << "bytes were copied into the slots: not read in place";
    }
    // The writer's wait returns only once every peer has read its pieces: rank 0 scribbles
    // over and frees its buffers at once, while the others start reading 100 ms late.
    const int64_t chunk = 4 * slot + 1;
    for (int round = 0; round < 3; ++round) {
      auto flat = arena_tensor(chunk * n);
      auto src = arena_tensor(chunk * n);
      src.copy_(random_flat(chunk * n, r + round));
      auto out = torch::empty({chunk});
      auto hg = comm::all_gather_into(pg, flat, rank_values(chunk, r + round));
      auto hr = comm::reduce_scatter(pg, out, src);
      if (r != 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      hg.wait();
      hr.wait();
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(torch::equal(flat.slice(0, q * chunk, (q + 1) * chunk), rank_values(chunk, q + round)))
            << "round " << round << ", chunk of rank " << q;
      }
      auto expect = random_flat(chunk * n, round).slice(0, r * chunk, (r + 1) * chunk).clone();
      for (int q = 1; q < n; ++q) expect = expect + random_flat(chunk * n, q + round).slice(0, r * chunk, (r + 1) * chunk);
      EXPECT_TRUE(torch::equal(out, expect)) << "round " << round;
      if (r == 0) {
        flat.fill_(std::nanf(""));
        src.fill_(std::nanf(""));
        flat = torch::Tensor();
        src = torch::Tensor();
      }
      comm::barrier(pg);
    }
  });
  std::vector<int> all(n);
  for (int q = 0; q < n; ++q) all[q] = q;
  run_case("shm: larger than the ring, in flight on two groups, waited out of order", [&] {
    auto g1 = pg.new_subgroup(all);
    auto g2 = pg.new_subgroup(all);
    ASSERT_NE(g1.shm_channel(), nullptr);
    const int64_t big = 24 * slot + 5;  // n x 6 MiB flat buffers, the ring holds 4 MiB
    auto f1 = random_flat(big * n, r), f2 = random_flat(big * n, r);
    auto o1 = torch::empty({big}), o3 = torch::empty({big});
    auto t = random_flat(big, r);
    auto gathered = torch::full({big * n}, -1.0f);
    auto h1 = comm::reduce_scatter(g1, o1, f1);
    auto h2 = comm::all_reduce(g2, t);
    auto h3 = comm::all_gather_into(g2, gathered, rank_values(big, r));
    auto h4 = comm::reduce_scatter(g1, o3, f2);
    // A Gloo operation waited while all of these are pending: the wait keeps feeding them.
    auto b = rank_values(5, r);
    comm::broadcast(pg, b, n - 1).wait();
    EXPECT_TRUE(torch::equal(b, rank_values(5, n - 1)));
    h4.wait();
    h2.wait();
    h3.wait();
    h1.wait();
    auto expected = reference_chunk(big, n, r);
    EXPECT_TRUE(torch::equal(o1, expected));
    EXPECT_TRUE(torch::equal(o3, expected));
    auto sum = random_flat(big, 0);
    for (int q = 1; q < n; ++q) sum = sum + random_flat(big, q);
    EXPECT_TRUE(torch::equal(t, sum));
    for (int q = 0; q < n; ++q) {
      EXPECT_TRUE(torch::equal(gathered.slice(0, q * big, (q + 1) * big), rank_values(big, q)));
    }
  });
}

// Every case against hand-computed values; run once per transport (`via`).
void basic_cases(comm::ProcessGroup& pg, const std::string& via) {
  const int n = pg.size();
  const int r = pg.rank();

  // Sizes that do and do not divide by the world size; padded to a multiple.
  for (int64_t numel : {1, 5, 64, 1001}) {
    const int64_t padded = comm::padded_numel(numel, n);
    const int64_t chunk = padded / n;
    run_case(via + "all_gather numel=" + std::to_string(numel), [&] {
      auto shard = rank_values(chunk, r);
      auto flat = torch::full({padded}, -1.0f);
      comm::comm_counters().reset();
      comm::all_gather_into(pg, flat, shard).wait();
      for (int src = 0; src < n; ++src) {
        EXPECT_TRUE(torch::equal(flat.slice(0, src * chunk, (src + 1) * chunk), rank_values(chunk, src)))
            << "chunk of rank " << src;
      }
      EXPECT_EQ(comm::comm_counters().all_gather.load(), int64_t(4) * chunk * (n - 1));
    });
    run_case(via + "reduce_scatter sum numel=" + std::to_string(numel), [&] {
      auto flat = rank_values(padded, r);
      auto out = torch::empty({chunk});
      comm::comm_counters().reset();
      comm::reduce_scatter(pg, out, flat, comm::ReduceOp::kSum).wait();
      // sum over ranks q of (i + 1000 (q+1)) for i in my chunk
      auto idx = torch::arange(r * chunk, (r + 1) * chunk, torch::kDouble);
      auto expected = (idx * n + 1000.0 * n * (n + 1) / 2).to(torch::kFloat);
      EXPECT_TRUE(torch::equal(out, expected)) << out << expected;
      EXPECT_EQ(comm::comm_counters().reduce_scatter.load(), int64_t(4) * chunk * (n - 1));
    });
    run_case(via + "reduce_scatter avg numel=" + std::to_string(numel), [&] {
      auto flat = rank_values(padded, r, torch::kDouble);
      auto out = torch::empty({chunk}, torch::kDouble);
      comm::reduce_scatter(pg, out, flat, comm::ReduceOp::kAvg).wait();
      auto idx = torch::arange(r * chunk, (r + 1) * chunk, torch::kDouble);
      auto expected = idx + 1000.0 * (n + 1) / 2;
      EXPECT_TRUE(torch::allclose(out, expected, 0, 1e-9)) << out << expected;
    });
  }
  run_case(via + "all_reduce", [&] {
    auto t = rank_values(7, r);
    comm::comm_counters().reset();
    comm::all_reduce(pg, t, comm::ReduceOp::kSum).wait();
    auto expected = (torch::arange(7, torch::kDouble) * n + 1000.0 * n * (n + 1) / 2).to(torch::kFloat);
    EXPECT_TRUE(torch::equal(t, expected));
    EXPECT_EQ(comm::comm_counters().all_reduce.load(), 2 * 28 * (n - 1) / n);
    auto a = torch::full({3}, double(r + 1), torch::kDouble);
    comm::all_reduce(pg, a, comm::ReduceOp::kAvg).wait();
    EXPECT_DOUBLE_EQ(a[0].item<double>(), (n + 1) / 2.0);
  });
  run_case(via + "broadcast", [&] {
    for (int root = 0; root < n; ++root) {
      auto t = rank_values(9, r);
      comm::broadcast(pg, t, root).wait();
      EXPECT_TRUE(torch::equal(t, rank_values(9, root))) << "root " << root;
    }
  });
  run_case(via + "async handles overlap", [&] {
    // Several collectives in flight at once complete independently.
    auto a = rank_values(n * 3, r), b = torch::empty({n * 3});
    auto s = rank_values(2, r), out = torch::empty({2});
    auto h1 = comm::all_gather_into(pg, b, rank_values(3, r));
    auto h2 = comm::reduce_scatter(pg, out, rank_values(2 * n, r));
    h2.wait();
    h1.wait();
    h1.wait();  // idempotent
    for (int src = 0; src < n; ++src) EXPECT_TRUE(torch::equal(b.slice(0, 3 * src, 3 * src + 3), rank_values(3, src)));
  });
  run_case(via + "bad sizes are rejected with the group name", [&] {
    try {
      comm::all_gather_into(pg, torch::empty({n * 2 + 1}), torch::empty({2}));
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("group 'world'"), std::string::npos) << e.what();
    }
  });
  if (n >= 2) {
    run_case(via + "subgroups", [&] {
      // Consecutive blocks of 2 (where it divides) and strided groups.
      if (n % 2 == 0) {
        auto block = pg.split_consecutive(2);
        ASSERT_TRUE(block.defined());
        EXPECT_EQ(block.size(), 2);
        EXPECT_EQ(block.rank(), r % 2);
        auto t = torch::full({1}, float(r));
        comm::all_reduce(block, t).wait();
        const int base = r / 2 * 2;
        EXPECT_EQ(t.item<float>(), float(base + base + 1));
        auto strided = pg.split_strided(2);
        auto u = torch::full({1}, float(r));
        comm::all_reduce(strided, u).wait();
        float expect = 0;
        for (int q = r % 2; q < n; q += 2) expect += q;
        EXPECT_EQ(u.item<float>(), expect);
        EXPECT_NE(strided.name(), block.name());
      }
      // A group that leaves rank 0 out.
      std::vector<int> tail;
      for (int q = 1; q < n; ++q) tail.push_back(q);
      auto g = pg.new_subgroup(tail);
      EXPECT_EQ(g.defined(), r != 0);
      if (g.defined()) {
        EXPECT_EQ(g.rank(), r - 1);
        EXPECT_EQ(g.global_ranks(), tail);
        auto t = torch::ones({2});
        comm::all_reduce(g, t).wait();
        EXPECT_EQ(t[0].item<float>(), float(n - 1));
      }
    });
  }
}

void collective_cases(comm::ProcessGroup& pg) {
  basic_cases(pg, "[shm] ");
  comm::set_comm_shared_memory(false);
  basic_cases(pg, "[gloo] ");
  pipeline_cases(pg);  // segments, alltoall and kept buffers: the Gloo path's own
  comm::set_comm_shared_memory(true);
  shm_cases(pg);
  comm::barrier(pg);
}

}  // namespace

// The blocked row sum against the ATen sequence it replaces, bit for bit: lengths
// around the block size (4096) and the threading threshold, 2-5 rows, 1 and 2 threads.
TEST(Collectives, RowSumKernelMatchesAtenOrder) {
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    for (int nrows : {2, 3, 4, 5}) {
      for (int64_t len : {int64_t(1), int64_t(4095), int64_t(4097), int64_t(3) << 16}) {
        std::vector<torch::Tensor> rows;
        for (int p = 0; p < nrows; ++p) rows.push_back(random_flat(len, p, dtype));
        auto expected = torch::empty({len}, dtype);
        at::add_out(expected, rows[0], rows[1]);
        for (int p = 2; p < nrows; ++p) expected.add_(rows[p]);
        for (int threads : {1, 2}) {
          auto got = torch::full({len}, -1.0, dtype);
          AT_DISPATCH_FLOATING_TYPES(dtype, "test", [&] {
            std::vector<const scalar_t*> ptrs;
            for (auto& row : rows) ptrs.push_back(row.data_ptr<scalar_t>());
            fsdp::comm::kernels::sum_rows(got.data_ptr<scalar_t>(), ptrs.data(), nrows, len, threads);
          });
          EXPECT_TRUE(torch::equal(got, expected))
              << dtype << " rows " << nrows << " len " << len << " threads " << threads;
        }
        // The order matters: a different order gives different bits (so the check above
        // can fail).
        if (dtype == torch::kFloat && nrows == 5 && len > 4096) {
          auto reversed = rows[4] + rows[3] + rows[2] + rows[1] + rows[0];
          EXPECT_FALSE(torch::equal(reversed, expected));
        }
      }
    }
  }
}

TEST(Collectives, WorldSizes1To4) {
  for (int n = 1; n <= 4; ++n) run_ranks(n, collective_cases);
}
