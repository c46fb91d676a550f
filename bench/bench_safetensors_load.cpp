// bench_safetensors_load: loading a safetensors file into a FULL_SHARD model
// (fsdp::load_safetensors), against a plain read of the same bytes measured in the same run, in
// rounds that alternate which side goes first:
//
//   throughput  plain seconds / load seconds (goal >= 0.8): the plain side preads, on every
//               rank, exactly the byte ranges the load reads (its shards' pieces of each
//               tensor) into a buffer of its own, allocated and touched before the clock starts
//   memory      a rank's peak resident-set growth during the load (VmHWM after clear_refs)
//               against 1.1x its shards' bytes + 16 MiB (goal <= 1); the largest over ranks
//
// --cold evicts the file from the page cache before each side (posix_fadvise DONTNEED), so
// both read from the disk; without it both read the page cache, which a first untimed read
// fills. Model: --layers Linear(D, D), one unit each, fp32 (the defaults: ~1.07 GB); the file
// is written once by save_safetensors from the wrapped model.
//
//   bench_safetensors_load [--nproc 4] [--rounds 5] [--layers 16] [--dim 4096] [--cold]
//                          [--settle-ms 0] [--dir /tmp]
//
// Without RANK in the environment it re-executes itself under fsdp-run (same bin directory).
// Rank 0 prints one JSON line per round, then the medians and ranges.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "bench_io.h"
#include "bench_launch.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/safetensors.h"
#include "fsdp/state/state_dict.h"
#include "state/safetensors_format.h"

using namespace fsdp;
namespace fs = std::filesystem;

namespace {

struct Args {
  int nproc = 4, rounds = 5, layers = 16, dim = 4096, settle_ms = 0;
  bool cold = false;
  std::string dir = "/tmp";
  std::vector<std::string> argv;  // as given, for the ranks' command line
};

const char* kUsage =
    "usage: bench_safetensors_load [--nproc 4] [--rounds 5] [--layers 16] [--dim 4096] [--cold]\n"
    "                              [--settle-ms 0] [--dir /tmp]\n"
    "(what it measures: the comment at the top of bench/bench_safetensors_load.cpp)\n";

Args parse_args(int argc, char** argv) {
  Args a;
  a.argv.assign(argv + 1, argv + argc);
  bench::parse_flags("bench_safetensors_load", kUsage, argc, argv,
                     {{"--nproc", &a.nproc, 1}, {"--rounds", &a.rounds, 1}, {"--layers", &a.layers, 1},
                      {"--dim", &a.dim, 1}, {"--settle-ms", &a.settle_ms, 0}},
                     {{"--dir", &a.dir}}, {{"--cold", &a.cold}});
  return a;
}

int launcher_main(const Args& a) { return bench::exec_under_launcher("bench_safetensors_load", a.nproc, a.argv); }

// ---- ranks --------------------------------------------------------------------------------

using Model = FullyShardedDataParallel<torch::nn::SequentialImpl>;

// The byte ranges of the file a rank's shards hold: what the load reads, and the plain side too.
struct Ranges {
  std::vector<std::pair<int64_t, int64_t>> spans;  // (file offset, bytes)
  int64_t bytes = 0;
};

Ranges ranges_of(Model& model, const std::string& file) {
  const auto header = state::safetensors::parse_header(file);
  std::map<std::string, int64_t> offset;
  for (const auto& t : header.tensors) offset[t.name] = t.begin;
  Ranges r;
  for (const auto& kv : sharded_state_dict(*model)) {
    const ShardedEntry& e = kv.value();
    const int64_t n = (e.end - e.begin) * 4;
    if (n == 0) continue;
    r.spans.emplace_back(offset.at(kv.key()) + e.begin * 4, n);
    r.bytes += n;
  }
  return r;
}

void plain_read(const std::string& file, const Ranges& r, char* buffer) {
  const int fd = ::open(file.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "bench: cannot open ", file);
  int64_t at = 0;
  for (const auto& [offset, n] : r.spans) {
    for (int64_t done = 0; done < n;) {
      const ssize_t got = ::pread(fd, buffer + at + done, n - done, offset + done);
      TORCH_CHECK(got > 0, "bench: reading ", file, " failed");
      done += got;
    }
    at += n;
  }
  ::close(fd);
}

struct Timed {
  double seconds = 0;
  int64_t peak_growth = 0;
};

// f between barriers (the file evicted first with --cold): the wall time until the slowest
// rank is done, and this rank's peak resident-set growth.
Timed timed(comm::ProcessGroup& pg, const Args& a, const std::string& file, const std::function<void()>& f) {
  comm::barrier(pg);
  if (pg.rank() == 0 && a.cold) {
    bench::evict(file);
    bench::settle(a.settle_ms);
  }
  comm::barrier(pg);
  Timed t;
  const double t0 = bench::now();
  t.peak_growth = bench::peak_rss_growth(f);
  comm::barrier(pg);
  t.seconds = bench::now() - t0;
  return t;
}

int rank_main(const Args& a) {
  auto pg = comm::init_process_group(comm::InitOptions());
  const int rank = pg.rank();
  const std::string dir = a.dir + "/bench_safetensors_load";
  const std::string file = dir + "/model.safetensors";
  if (rank == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  torch::nn::Sequential net;
  torch::manual_seed(0);
  for (int i = 0; i < a.layers; ++i) net->push_back(torch::nn::Linear(a.dim, a.dim));
  Model model(net, pg, Options().auto_wrap_policy(always_wrap_policy()));
  net = nullptr;
  save_safetensors(*model, dir);
  const Ranges mine = ranges_of(model, file);
  std::vector<char> buffer(static_cast<size_t>(mine.bytes), 1);  // touched: resident before the clock
  const double gb = double(fs::file_size(file)) / 1e9;
  if (rank == 0)
    std::printf("bench_safetensors_load: %d ranks, %d layers of %dx%d fp32, FULL_SHARD; a %.3f GB file, %s\n",
                pg.size(), a.layers, a.dim, a.dim, gb,
                a.cold ? "evicted before each side (cold)" : "in the page cache (cached)");
  plain_read(file, mine, buffer.data());  // fills the page cache for the cached rounds
  std::vector<double> speed, memory;
  for (int r = 0; r < a.rounds; ++r) {
    Timed load, plain;
    int64_t read = 0;
    auto do_load = [&] { load = timed(pg, a, file, [&] { read = load_safetensors(*model, dir).bytes_read; }); };
    auto do_plain = [&] { plain = timed(pg, a, file, [&] { plain_read(file, mine, buffer.data()); }); };
    if (r % 2 == 0) {
      do_load();
      do_plain();
    } else {
      do_plain();
      do_load();
    }
    TORCH_CHECK(read == mine.bytes, "bench: the load read ", read, " bytes, the plain side ", mine.bytes);
    const double bound = 1.1 * double(mine.bytes) + double(16 << 20);
    auto worst = torch::tensor({double(load.peak_growth) / bound}, torch::kDouble);
    comm::all_reduce(pg, worst, comm::ReduceOp::kMax).wait();
    speed.push_back(plain.seconds / load.seconds);
    memory.push_back(worst.item<double>());
    if (rank == 0)
      std::printf("{\"round\": %d, \"load_seconds\": %.4f, \"plain_seconds\": %.4f, \"ratio\": %.3f, "
                  "\"load_gb_per_s\": %.3f, \"rank0_peak_growth_mib\": %.1f, \"rank0_shard_mib\": %.1f, "
                  "\"worst_peak_over_bound\": %.4f}\n",
                  r, load.seconds, plain.seconds, speed.back(), gb / load.seconds,
                  double(load.peak_growth) / (1 << 20), double(mine.bytes) / (1 << 20), memory.back());
    std::fflush(stdout);
  }
  if (rank == 0) {
    auto row = [&](const char* what, const std::vector<double>& v, const char* goal) {
      std::printf("%-52s median %.4f (%.4f-%.4f), %d rounds; goal %s\n", what, bench::median(v),
                  *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()), a.rounds, goal);
    };
    row(a.cold ? "load / plain read of the same bytes (cold)" : "load / plain read of the same bytes (cached)", speed,
        ">= 0.8");
    row("peak RSS growth / (1.1 x shard bytes + 16 MiB), worst rank", memory, "<= 1");
  }
  comm::barrier(pg);
  if (rank == 0) fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::bench::launcher_or_rank_main("bench_safetensors_load", parse_args(argc, argv), launcher_main,
                                           rank_main);
}
