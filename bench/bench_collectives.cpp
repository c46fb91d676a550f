// bench_collectives: bus bandwidth of fsdp::comm's all-gather and reduce-scatter against
// Gloo's own all-reduce, measured in the same run on the same buffer.
//
// Usage:
//   bench_collectives [--world-sizes 2,4] [--sizes-mb 1,16,64] [--reps 10] [--reps-large 5]
//                     [--reps-small 50]
//                     [--warmup 3] [--timeout-ms 300000] [--segment-kb 4096]
//                     [--alltoall-kb 2048]
//
// Without RANK in the environment it re-executes itself under the fsdp-run that sits next
// to it (same bin/ directory), once per world size, and prints rank 0's report with the
// "[rank0]: " prefix removed. Under a launcher it runs the measurement directly, also across
// hosts: `fsdp-run --nnodes 2 --node-rank R --master-addr A --master-port P --nproc 2 --
// bench_collectives --sizes-mb 1` on each host (bench/measure_multihost.sh); there every
// group spans the hosts and every op goes over Gloo/TCP.
//
// Words used below:
//   flat buffer  the full fp32 buffer of `mb` MiB (size S bytes), as FSDP all-gathers it
//   shard        this rank's 1/N of it
//   rep          one timed call of every op, in a fixed order, each after a barrier; a rep's
//                time for an op is the slowest rank's time (max over ranks), and an op's
//                reported time is the median over reps. Interleaving the ops inside each rep
//                gives every op the same background load (the machine is shared).
//   busbw        nccl-tests' bus bandwidth: what each rank sends (and receives) per second on
//                the optimal algorithm. All-gather and reduce-scatter: S*(N-1)/N / t;
//                all-reduce: 2*S*(N-1)/N / t. Equal busbw means equal use of the links, so
//                "ours >= 0.9x Gloo's all-reduce busbw" is the target. "vs gloo AR" is the
//                median (and range) over reps of an op's busbw over Gloo's all-reduce busbw
//                in the same rep.
//
// Ops timed (the first four are the report; the rest explain it):
//   gloo_allreduce   pg.c10d()->allreduce on the flat buffer: the baseline
//   all_reduce       fsdp::comm::all_reduce
//   all_gather_into  fsdp::comm::all_gather_into(flat, shard)
//   reduce_scatter   fsdp::comm::reduce_scatter(out, flat)
//                    (these three go through shared memory when every rank is on this host,
//                    which bench ranks are: [Note: shared-memory transport] in
//                    src/comm/shm/shm_channel.cpp)
//   *_gloo           the same three calls with the shared-memory transport switched off
//                    (set_comm_shared_memory(false)): our Gloo paths, described next
//   gloo_alltoall    reduce_scatter's transfer alone: c10d alltoall_base into a buffer
//                    allocated once (no per-call allocation, no local sum)
//   gloo_allgather   Gloo's own allgather into the N chunk views (what all_gather_into used
//                    before it moved to send/recv): Gloo 1.13 gathers into a flat tensor it
//                    allocates on every call and then copies that into the views
//   rs_sum           reduce_scatter's local sum alone, unoverlapped: N rows of an S-byte
//                    buffer into the shard
//   fresh_buffer     allocating an S-byte tensor and touching it once: what a per-call
//                    receive buffer costs; above glibc's mmap threshold (32 MiB at most)
//                    that is page faults every time
// reduce_scatter and all_gather_into are built from Gloo send/recv (see
// src/comm/gloo/gloo_p2p.cpp), in segments of --segment-kb (default 4096); reduce_scatter
// overlaps the sum of each segment with the transfer of the next and keeps a large receive
// buffer per group; all_gather_into receives straight into the chunk views. At N >= 3, flat
// buffers up to --alltoall-kb (default 2048; 0: never) go through Gloo's alltoall instead.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/comm_testing.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"
#include "bench_launch.h"

namespace {

namespace comm = fsdp::comm;
using Clock = std::chrono::steady_clock;

struct Args {
  std::vector<int> world_sizes{2, 4};
  std::vector<int> sizes_mb{1, 16, 64};
  int reps = 10;
  int reps_large = 5;  // for buffers of 64 MiB and more
  // Buffers below 4 MiB: a collective takes a few hundred microseconds there, so one
  // scheduler hiccup moves a sample by 2-5x; the median needs more samples to settle.
  int reps_small = 50;
  int warmup = 3;
  long timeout_ms = 300000;
  long segment_kb = 4096;
  long alltoall_kb = 2048;  // set_comm_alltoall_max_bytes; 0: send/recv at every size
  std::vector<std::string> passthrough;  // argv[1..] for the re-executed ranks
};

const char* kUsage =
    "usage: bench_collectives [--world-sizes 2,4] [--sizes-mb 1,16,64] [--reps 10] [--reps-small 50]\n"
    "                         [--reps-large 5] [--warmup 3] [--timeout-ms 300000] [--segment-kb 4096]\n"
    "                         [--alltoall-kb 2048]\n"
    "(what each measures: the comment at the top of bench/bench_collectives.cpp)\n";

[[noreturn]] void usage_error(const std::string& what) {
  fsdp::tools::print_error("bench_collectives", what + "\n" + kUsage);
  std::exit(2);
}

long parse_long(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0') {
    usage_error(flag + " expects an integer, got '" + value + "'");
  }
  return v;
}

std::vector<int> parse_list(const std::string& flag, const std::string& value) {
  std::vector<int> out;
  std::stringstream ss(value);
  std::string item;
  while (std::getline(ss, item, ',')) {
    long v = parse_long(flag, item);
    if (v < 1) usage_error(flag + " values must be >= 1");
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) usage_error(flag + " needs at least one value");
  return out;
}

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    args.passthrough.push_back(a);
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error("unknown argument or missing value: '" + a + "'");
    std::string v = argv[++i];
    args.passthrough.push_back(v);
    if (a == "--world-sizes") {
      args.world_sizes = parse_list(a, v);
    } else if (a == "--sizes-mb") {
      args.sizes_mb = parse_list(a, v);
    } else if (a == "--reps") {
      args.reps = static_cast<int>(parse_long(a, v));
    } else if (a == "--reps-small") {
      args.reps_small = static_cast<int>(parse_long(a, v));
    } else if (a == "--reps-large") {
      args.reps_large = static_cast<int>(parse_long(a, v));
    } else if (a == "--warmup") {
      args.warmup = static_cast<int>(parse_long(a, v));
    } else if (a == "--segment-kb") {
      args.segment_kb = parse_long(a, v);
    } else if (a == "--alltoall-kb") {
      args.alltoall_kb = parse_long(a, v);
    } else if (a == "--timeout-ms") {
      args.timeout_ms = parse_long(a, v);
    } else {
      usage_error("unknown argument '" + a + "'");
    }
  }
  if (args.reps < 1 || args.reps_large < 1 || args.reps_small < 1 || args.warmup < 0 || args.timeout_ms <= 0 ||
      args.segment_kb < 1 || args.alltoall_kb < 0) {
    usage_error("--reps, --reps-small and --reps-large must be >= 1, --warmup >= 0, --timeout-ms and "
                "--segment-kb > 0, --alltoall-kb >= 0");
  }
  return args;
}

// ---- launcher mode ------------------------------------------------------------------------

// Runs `fsdp-run --nproc N -- self args...` (bench/bench_launch.h); rank 0's stdout
// lines lose their prefix.
int run_under_launcher(const std::string& launcher, const std::string& self, int world,
                       const std::vector<std::string>& passthrough) {
  std::string cmd = fsdp::bench::shell_quote(launcher) + " --nproc " + std::to_string(world) +
                    " -- " + fsdp::bench::shell_quote(self);
  for (const auto& a : passthrough) cmd += " " + fsdp::bench::shell_quote(a);
  return fsdp::bench::run_lines(cmd, [](const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  });
}

int launcher_main(const Args& args) {
  const std::string self = fsdp::bench::self_exe("bench_collectives");
  const std::string launcher = fsdp::bench::launcher_next_to(self);
  if (::access(launcher.c_str(), X_OK) != 0) {
    std::fprintf(stderr,
                 "bench_collectives: %s not found; build it (cmake --build <build> --target "
                 "fsdp-run) or start this under a launcher (RANK set)\n",
                 launcher.c_str());
    return 1;
  }
  int worst = 0;
  for (int world : args.world_sizes) {
    int rc = run_under_launcher(launcher, self, world, args.passthrough);
    if (rc != 0) {
      std::fprintf(stderr, "bench_collectives: world size %d failed (exit %d)\n", world, rc);
      worst = rc;
    }
  }
  return worst;
}

// ---- rank mode ----------------------------------------------------------------------------

struct Op {
  std::string name;
  bool report;          // part of the main table (the rest are the breakdown)
  double bus_factor;    // busbw = bus_factor * S*(N-1)/N / t; 0: not a transfer
  std::function<void()> run;
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

int rank_main(const Args& args) {
  auto pg = comm::init_process_group(
      comm::InitOptions().timeout(std::chrono::milliseconds(args.timeout_ms)));
  const int n = pg.size();
  const int rank = pg.rank();
  comm::set_comm_segment_bytes(int64_t(args.segment_kb) * 1024);
  comm::set_comm_alltoall_max_bytes(int64_t(args.alltoall_kb) * 1024);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const auto f32 = at::TensorOptions().dtype(at::kFloat);

  struct Row {
    int mb;
    std::string op;
    bool report;
    double ms;
    std::optional<double> busbw;
    std::optional<double> ratio;  // median over reps of busbw / Gloo all-reduce's busbw in the same rep
    double ratio_min = 0, ratio_max = 0;
  };
  std::vector<Row> rows;

  for (int mb : args.sizes_mb) {
    const int64_t numel = comm::padded_numel(int64_t(mb) * 1024 * 1024 / 4, n);
    const double bytes = double(numel) * 4.0;
    const int64_t chunk = numel / n;
    // Zeros: sums stay zero, so repeated all-reduces never reach inf or denormals.
    auto flat = at::zeros({numel}, f32);
    auto shard = at::zeros({chunk}, f32);
    auto out = at::zeros({chunk}, f32);
    auto received = at::zeros({numel}, f32);

    std::vector<Op> ops;
    ops.push_back({"gloo_allreduce", true, 2.0, [&] {
                     std::vector<at::Tensor> t{flat};
                     pg.c10d()->allreduce(t)->wait(pg.timeout());
                   }});
    ops.push_back({"all_reduce", true, 2.0, [&] { comm::all_reduce(pg, flat).wait(); }});
    ops.push_back({"all_gather_into", true, 1.0,
                   [&] { comm::all_gather_into(pg, flat, shard).wait(); }});
    ops.push_back({"reduce_scatter", true, 1.0,
                   [&] { comm::reduce_scatter(pg, out, flat).wait(); }});
    auto over_gloo = [](const std::function<void()>& f) {
      comm::set_comm_shared_memory(false);
      f();
      comm::set_comm_shared_memory(true);
    };
    ops.push_back({"all_reduce_gloo", false, 2.0,
                   [&] { over_gloo([&] { comm::all_reduce(pg, flat).wait(); }); }});
    ops.push_back({"all_gather_gloo", false, 1.0,
                   [&] { over_gloo([&] { comm::all_gather_into(pg, flat, shard).wait(); }); }});
    ops.push_back({"reduce_scatter_gloo", false, 1.0,
                   [&] { over_gloo([&] { comm::reduce_scatter(pg, out, flat).wait(); }); }});
    ops.push_back({"gloo_alltoall", false, 1.0, [&] {
                     std::vector<int64_t> equal;
                     pg.c10d()->alltoall_base(received, flat, equal, equal)->wait(pg.timeout());
                   }});
    ops.push_back({"gloo_allgather", false, 1.0, [&] {
                     std::vector<std::vector<at::Tensor>> outputs(1);
                     auto chunks = flat.view({n, chunk});
                     for (int i = 0; i < n; ++i) outputs[0].push_back(chunks[i]);
                     std::vector<at::Tensor> inputs{shard};
                     pg.c10d()->allgather(outputs, inputs)->wait(pg.timeout());
                   }});
    ops.push_back({"rs_sum", false, 0.0, [&] {
                     auto r = received.view({n, chunk});
                     out.copy_(r[0]);
                     for (int i = 1; i < n; ++i) out.add_(r[i]);
                   }});
    ops.push_back({"fresh_buffer", false, 0.0, [&] {
                     auto fresh = at::empty_like(flat);
                     fresh.zero_();
                   }});

    const int reps = mb >= 64 ? args.reps_large : mb < 4 ? args.reps_small : args.reps;
    for (int w = 0; w < args.warmup; ++w) {
      for (auto& op : ops) op.run();
    }
    // times[o * reps + r]: this rank's seconds for op o in rep r.
    auto times = at::zeros({int64_t(ops.size()) * reps}, at::TensorOptions().dtype(at::kDouble));
    double* tp = times.data_ptr<double>();
    for (int r = 0; r < reps; ++r) {
      for (size_t o = 0; o < ops.size(); ++o) {
        comm::barrier(pg);
        auto t0 = Clock::now();
        ops[o].run();
        tp[o * reps + r] = std::chrono::duration<double>(Clock::now() - t0).count();
      }
    }
    // The slowest rank defines a collective's time.
    {
      std::vector<at::Tensor> t{times};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::MAX;
      pg.c10d()->allreduce(t, opts)->wait(pg.timeout());
    }
    // Ratios to Gloo's all-reduce are taken rep by rep (the ops of one rep ran back to back,
    // so load that comes and goes hits both alike), then their median and range.
    for (size_t o = 0; o < ops.size(); ++o) {
      std::vector<double> v(tp + o * reps, tp + (o + 1) * reps);
      const double t = fsdp::bench::median(v);
      Row row{mb, ops[o].name, ops[o].report, t * 1e3, std::nullopt, std::nullopt};
      if (ops[o].bus_factor > 0) {
        row.busbw = ops[o].bus_factor * bytes * (n - 1) / n / t / 1e9;
        std::vector<double> ratios;
        for (int r = 0; r < reps; ++r)
          ratios.push_back(ops[o].bus_factor / tp[o * reps + r] / (ops[0].bus_factor / tp[r]));
        row.ratio = fsdp::bench::median(ratios);
        row.ratio_min = *std::min_element(ratios.begin(), ratios.end());
        row.ratio_max = *std::max_element(ratios.begin(), ratios.end());
      }
      rows.push_back(row);
    }
  }

  if (rank == 0) {
    std::string load = "?";
    if (FILE* f = std::fopen("/proc/loadavg", "r")) {
      char buf[128] = {0};
      if (std::fgets(buf, sizeof(buf), f)) load = std::string(buf, std::strcspn(buf, "\n"));
      std::fclose(f);
    }
    std::printf("bench_collectives: world_size=%d on %u cores%s, fp32, median of %d reps "
                "(%d below 4 MiB, %d for >= 64 MiB; max over ranks), %d warm-up, intra-op threads %d\n",
                n, cores, n > int(cores) ? " (OVERSUBSCRIBED: more ranks than cores)" : "",
                args.reps, args.reps_small, args.reps_large, args.warmup, at::get_num_threads());
    std::printf("load average at the end of the measurements: %s\n", load.c_str());
    std::printf("busbw: all-gather/reduce-scatter S*(N-1)/N/t, all-reduce 2*S*(N-1)/N/t "
                "(nccl-tests), GB = 1e9 bytes, MB = MiB\n");
    std::printf("%6s %-20s %10s %12s %22s\n", "MB", "op", "ms", "busbw GB/s", "vs gloo AR (range)");
    auto print_rows = [&](bool report) {
      for (const auto& r : rows) {
        if (r.report != report) continue;
        std::string ratio = "-";
        if (r.ratio) ratio = fmt("%.2fx", *r.ratio) + " (" + fmt("%.2f", r.ratio_min) + "-" + fmt("%.2f", r.ratio_max) + ")";
        std::printf("%6d %-20s %10.2f %12s %22s\n", r.mb, r.op.c_str(), r.ms,
                    r.busbw ? fmt("%.3f", *r.busbw).c_str() : "-", ratio.c_str());
      }
    };
    print_rows(true);
    std::printf("reference points (segment %ld KiB, alltoall path up to %ld KiB): Gloo's "
                "alltoall and allgather alone, the unoverlapped sum, a fresh buffer\n",
                args.segment_kb, args.alltoall_kb);
    print_rows(false);
    for (const auto& r : rows) {
      std::printf("{\"op\": \"%s\", \"world_size\": %d, \"mb\": %d, \"ms\": %.4f, "
                  "\"busbw_gb_s\": %s, \"ratio_vs_gloo_allreduce\": %s, \"ratio_min\": %s, \"ratio_max\": %s}\n",
                  r.op.c_str(), n, r.mb, r.ms, r.busbw ? fmt("%.4f", *r.busbw).c_str() : "null",
                  r.ratio ? fmt("%.4f", *r.ratio).c_str() : "null", r.ratio ? fmt("%.4f", r.ratio_min).c_str() : "null",
                  r.ratio ? fmt("%.4f", r.ratio_max).c_str() : "null");
    }
    std::fflush(stdout);
  }
  comm::barrier(pg);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::bench::launcher_or_rank_main("bench_collectives", parse_args(argc, argv), launcher_main, rank_main);
}
