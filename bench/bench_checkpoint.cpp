// bench_checkpoint: P ranks save and load a sharded checkpoint of a ~100M-parameter
// model with Adam state, each against a baseline of the same bytes with the same
// number of processes and files (one per rank), measured in the same run:
//
//   save (cold)   vs plain write + fsync of the same bytes per rank
//   load (cold)   vs plain read of the same bytes per rank; both evicted from the
//                 page cache first (fdatasync + posix_fadvise(DONTNEED), which
//                 works on clean pages without root)
//   load (cached) vs plain read + CRC-32 of the same bytes, both in the page cache
//   consolidate   (fsdp-ckpt consolidate, one process) vs copying as many bytes
//                 out of the rank files into one file + fsync
//
// The plain reads land in a buffer the size of the rank's bytes, touched
// beforehand, as a load lands in the model's (already touched) parameter and
// optimizer storage. Ratio = baseline seconds / checkpoint seconds (target >= 0.8).
// Before every cold region (save, cold load, write, cold read) the bench waits until
// the VM's free page reporting is quiet, so a load and its baseline allocate their page
// cache from memory in the same state ([Note: settle before cold regions]).
//
//   bench_checkpoint [--params N] [--dir DIR] [--nproc P] [--reps R] [--settle-ms S]
//
// Without RANK in the environment it re-executes itself under fsdp-run (same bin
// directory). Prints a table and JSON lines {op, ranks, bytes, seconds, gb_s,
// baseline, baseline_seconds, baseline_gb_s, ratio} (bytes: all ranks together).
// Also reports the bytes allocated on each rank during save and load beyond what
// it held (save target: <= its shard + the largest unit; the save makes no copies),
// and a rank's peak resident-set growth during the cold load (the load maps the
// rank files it verifies: page cache, see [Note: atomic load]).
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "bench_io.h"
#include "bench_launch.h"
#include "common/tool_error.h"
#include "core/counting_allocator.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/checkpoint.h"
#include "state/checkpoint_testing.h"
#include "fsdp/state/checkpoint_tools.h"

using namespace fsdp;
namespace fs = std::filesystem;

namespace {

using fsdp::bench::cpu_now;
using fsdp::bench::now;
using fsdp::bench::peak_rss_growth;
using fsdp::bench::plain_write;

// Fraction of a file's pages in the page cache (mincore), 0 if it cannot tell. The
// VM's DAMON pageout scheme can reclaim pages that look idle between phases, so a
// "cached" region reports how cached its input really was.
double resident_fraction(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return 0;
  struct stat st {};
  ::fstat(fd, &st);
  double frac = 0;
  if (st.st_size > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      const long page = ::sysconf(_SC_PAGESIZE);
      std::vector<unsigned char> v((static_cast<size_t>(st.st_size) + page - 1) / page);
      if (::mincore(p, static_cast<size_t>(st.st_size), v.data()) == 0) {
        size_t in = 0;
        for (unsigned char c : v) in += c & 1;
        frac = static_cast<double>(in) / static_cast<double>(v.size());
      }
      ::munmap(p, static_cast<size_t>(st.st_size));
    }
  }
  ::close(fd);
  return frac;
}

using fsdp::bench::evict;
using fsdp::bench::settle;
using fsdp::bench::vm_reported_kib;

// The CRC-32 the library uses (libdeflate when present, zlib otherwise or with
// FSDP_CKPT_ZLIB_CRC), so the cached-load baseline checksums as a load must.
using Crc32Fn = unsigned long (*)(unsigned long, const void*, size_t);
Crc32Fn crc32_fn() {
  static const Crc32Fn fn = [] {
    void* lib = std::getenv("FSDP_CKPT_ZLIB_CRC") ? nullptr : ::dlopen("libdeflate.so.0", RTLD_NOW | RTLD_LOCAL);
    if (lib) return reinterpret_cast<Crc32Fn>(::dlsym(lib, "libdeflate_crc32"));
    return reinterpret_cast<Crc32Fn>(::dlsym(::dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL), "crc32"));
  }();
  return fn;
}

// Reads the file into `dst`; with `crc`, checksums each 1 MiB chunk after reading it.
void plain_read(const std::string& path, char* dst, int64_t n, bool crc) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "bench_checkpoint: cannot open ", path);
  unsigned long c = 0;
  for (int64_t done = 0; done < n;) {
    const ssize_t r = ::read(fd, dst + done, std::min<int64_t>(n - done, crc ? (1 << 20) : (8 << 20)));
    TORCH_CHECK(r > 0, "bench_checkpoint: reading ", path, " failed");
    if (crc) c = crc32_fn()(c, dst + done, static_cast<size_t>(r));
    done += r;
  }
  ::close(fd);
  volatile unsigned long sink = c;
  (void)sink;
}

const char* kUsage =
    "usage: bench_checkpoint [--params N] [--dir DIR] [--nproc P] [--reps R] [--settle-ms S]\n"
    "  --params N   model size in parameters (default 100000000)\n"
    "  --dir DIR    where the checkpoint and the plain files go (default /tmp)\n"
    "  --nproc P    ranks started under fsdp-run (default 4)\n"
    "  --reps R     repeat the cold and cached loads and their baselines R times in all\n"
    "               (default 1); repetitions 2..R print one JSON line per op with \"rep\"\n"
    "  --settle-ms S before each cold region, wait until this VM's free page reporting has been\n"
    "               quiet for S ms (default 2500; 0: no wait, the order of older builds)\n";

// --help prints the usage and exits 0; an unknown flag, a flag without its value or a
// value that is not a positive number exits 2. Checked before any rank starts.
void check_args(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    std::string why;
    if (a != "--params" && a != "--dir" && a != "--nproc" && a != "--reps" && a != "--settle-ms") why = "unknown argument '" + a + "'";
    else if (i + 1 >= argc) why = a + " needs a value";
    else if (a != "--dir") {
      const std::string v = argv[++i];
      char* end = nullptr;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      const long long least = a == "--settle-ms" ? 0 : 1;
      if (v.empty() || *end != '\0' || n < least)
        why = a + " expects " + (least ? "a positive" : "a non-negative") + " integer, got '" + v + "'";
    } else {
      ++i;
    }
    if (!why.empty()) {
      fsdp::tools::print_error("bench_checkpoint", why + "\n" + kUsage);
      std::exit(2);
    }
  }
}

std::string arg(int argc, char** argv, const std::string& name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return def;
}

int rank_main(int argc, char** argv) {
  auto* counter = fsdp::memory::install_counting_allocator();
  const int64_t target = std::stoll(arg(argc, argv, "--params", "100000000"));
  const std::string dir = arg(argc, argv, "--dir", "/tmp") + "/bench_checkpoint";
  auto pg = comm::init_process_group(comm::InitOptions());
  const int rank = pg.rank(), world = pg.size();

  // Sequential of D x D layers, one unit each; D = 2048 gives 4.2M per layer.
  const int64_t d = 2048;
  const int layers = static_cast<int>(std::max<int64_t>(1, target / (d * d + d)));
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < layers; ++i) net->push_back(torch::nn::Linear(d, d));
  FullyShardedDataParallel model(net, pg, Options().auto_wrap_policy(always_wrap_policy()));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-4));
  model->forward(torch::randn({1, d})).sum().backward();
  opt.step();
  const int64_t numel = layers * (d * d + d);
  const int64_t unit_bytes = (d * d + d) * 4;
  const int64_t shard_bytes = (numel / world) * 4 * 3;  // params + exp_avg + exp_avg_sq

  if (rank == 0) fs::remove_all(dir);
  if (rank == 0) fs::create_directories(dir);
  comm::barrier(pg);
  // Every timed region runs between barriers, so it ends when the slowest rank is done.
  std::vector<double> cpu;     // this rank's CPU seconds of each timed region, in order
  std::vector<double> vm_mib;  // MiB the VM reported (handed back) during each region; -1: no counter
  const int64_t settle_ms = std::stoll(arg(argc, argv, "--settle-ms", "2500"));
  // A cold region first waits for the VM's page reporting to settle ([Note: settle before
  // cold regions]); every rank has evicted its input by then (the first barrier).
  auto timed = [&](const std::function<void()>& f, bool cold) {
    comm::barrier(pg);
    if (cold && rank == 0) settle(settle_ms);
    comm::barrier(pg);
    const int64_t k0 = vm_reported_kib();
    const double t0 = now(), c0 = cpu_now();
    f();
    cpu.push_back(cpu_now() - c0);
    comm::barrier(pg);
    const double s = now() - t0;
    vm_mib.push_back(k0 < 0 ? -1.0 : (vm_reported_kib() - k0) / 1024.0);
    return s;
  };
  auto peak_since = [&](const std::function<void()>& f, double* seconds) {
    const int64_t live_before = counter->live();
    counter->reset_peak();
    *seconds = timed(f, true);
    return counter->peak() - live_before;
  };

  // 1. Checkpoint save (the timed region includes every rank's fsync and the rename).
  double save_s = 0, load_cold_s = 0, load_cached_s = 0;
  const int64_t save_extra = peak_since([&] { save_checkpoint(dir + "/ckpt", *model, &opt); }, &save_s);
  int64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(dir + "/ckpt"))
    if (e.path().extension() == ".bin") bytes += static_cast<int64_t>(e.file_size());
  char name[64];
  std::snprintf(name, sizeof(name), "/ckpt/shard_rank%05d.bin", rank);
  const std::string my_file = dir + name;
  const int64_t my_bytes = fs::exists(my_file) ? static_cast<int64_t>(fs::file_size(my_file)) : 0;

  // 2. Load (same world size) from disk, then again from the page cache.
  evict(my_file);
  if (rank == 0) evict(dir + "/ckpt/metadata.json");
  int64_t load_rss = 0;
  const int64_t load_extra = peak_since(
      [&] { load_rss = peak_rss_growth([&] { load_checkpoint(dir + "/ckpt", *model, &opt); }); }, &load_cold_s);
  const double resident_load_cached = resident_fraction(my_file);
  load_cached_s = timed([&] { load_checkpoint(dir + "/ckpt", *model, &opt); }, false);

  // 3. The baselines: the same bytes per rank, one file per rank, same processes.
  const std::string plain = dir + "/plain_rank" + std::to_string(rank) + ".bin";
  auto data = at::empty({std::max<int64_t>(my_bytes, 1)}, at::kByte);
  char* buf = reinterpret_cast<char*>(data.data_ptr<uint8_t>());
  for (int64_t i = 0; i < my_bytes; ++i) buf[i] = static_cast<char>(i * 131 + (i >> 12));  // touched, not zero
  const double write_s = timed([&] { plain_write(plain, buf, my_bytes); }, true);
  evict(plain);
  const double read_cold_s = timed([&] { plain_read(plain, buf, my_bytes, false); }, true);
  // Straight after the cold read, as the cached load follows the cold load: the
  // same page-cache history (pages read once, not yet promoted to the active list).
  const double resident_read_crc = resident_fraction(plain);
  const double read_crc_s = timed([&] { plain_read(plain, buf, my_bytes, true); }, false);

  // 4. fsdp-ckpt consolidate (rank 0, one process) against copying the same
  // number of bytes out of the rank files into one file + fsync, through a 1 MiB
  // buffer; both read the checkpoint from the page cache (the loads left it there).
  double consolidate_s = 0, copy_s = 0, consolidate_cpu = 0, copy_cpu = 0;
  int64_t consolidated = 0;
  double resident_consolidate = 0;  // of all rank files together
  if (rank == 0) {
    const std::string out = dir + "/full.pt";
    for (int r = 0; r < world; ++r) {
      char f[64];
      std::snprintf(f, sizeof(f), "/ckpt/shard_rank%05d.bin", r);
      resident_consolidate += resident_fraction(dir + f) / world;
    }
    double t0 = now(), c0 = cpu_now();
    consolidate_checkpoint(dir + "/ckpt", out);
    consolidate_s = now() - t0;
    consolidate_cpu = cpu_now() - c0;
    consolidated = static_cast<int64_t>(fs::file_size(out));
    std::vector<char> chunk(1 << 20);
    t0 = now();
    c0 = cpu_now();
    const int ofd = ::open((dir + "/copy.bin").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int64_t left = consolidated;
    for (int r = 0; r < world && left > 0; ++r) {
      char f[64];
      std::snprintf(f, sizeof(f), "/ckpt/shard_rank%05d.bin", r);
      const int ifd = ::open((dir + f).c_str(), O_RDONLY);
      ssize_t n = 0;
      while (left > 0 && (n = ::read(ifd, chunk.data(), std::min<int64_t>(left, chunk.size()))) > 0) {
        TORCH_CHECK(::write(ofd, chunk.data(), n) == n, "bench_checkpoint: writing copy.bin failed");
        left -= n;
      }
      ::close(ifd);
    }
    ::fsync(ofd);
    ::close(ofd);
    copy_s = now() - t0;
    copy_cpu = cpu_now() - c0;
  }

  auto extra = torch::tensor({save_extra, load_extra, load_rss, my_bytes}, torch::kLong);
  comm::all_reduce(pg, extra, comm::ReduceOp::kMax).wait();
  auto cpu_all = torch::tensor(cpu, torch::kDouble);  // summed over ranks
  comm::all_reduce(pg, cpu_all).wait();
  // The least-cached rank's input of each "cached" region (mincore just before it).
  auto resident = torch::tensor({-resident_load_cached, -resident_read_crc}, torch::kDouble);
  comm::all_reduce(pg, resident, comm::ReduceOp::kMax).wait();
  resident = -resident;
  const auto c = cpu_all.accessor<double, 1>();
  if (rank == 0) {
    const double gb = bytes / 1e9;
    std::printf("bench_checkpoint: %d ranks, %d layers of %ldx%ld, %.1fM parameters, Adam state; %.3f GB on disk "
                "in %s; CRC-32 %s\n", world, layers, (long)d, (long)d, numel / 1e6, gb, dir.c_str(),
                std::getenv("FSDP_CKPT_ZLIB_CRC") ? "zlib" : "libdeflate if present");
    struct Row {
      const char* op;
      double s, cpu;
      const char* base;
      double bs, bcpu;
      double vm, bvm;  // MiB the VM reported during the region and during its baseline
    };
    // Timed regions in order: save, load cold, load cached, write, read cold, read + CRC.
    const Row rows[] = {{"save_cold", save_s, c[0], "write+fsync", write_s, c[3], vm_mib[0], vm_mib[3]},
                        {"load_cold", load_cold_s, c[1], "read", read_cold_s, c[4], vm_mib[1], vm_mib[4]},
                        {"load_cached", load_cached_s, c[2], "read+crc", read_crc_s, c[5], vm_mib[2], vm_mib[5]}};
    std::printf("%-12s %9s %8s %8s   %-12s %9s %8s %8s %7s %9s\n", "op", "seconds", "GB/s", "cpu s", "baseline",
                "seconds", "GB/s", "cpu s", "ratio", "cpu ratio");
    for (const auto& r : rows)
      std::printf("%-12s %9.3f %8.3f %8.3f   %-12s %9.3f %8.3f %8.3f %7.2f %9.2f\n", r.op, r.s, gb / r.s, r.cpu,
                  r.base, r.bs, gb / r.bs, r.bcpu, r.bs / r.s, r.bcpu / r.cpu);
    std::printf("%-12s %9.3f %8.3f %8.3f   %-12s %9.3f %8.3f %8.3f %7.2f %9.2f\n", "consolidate", consolidate_s,
                consolidated / 1e9 / consolidate_s, consolidate_cpu, "read+write", copy_s, consolidated / 1e9 / copy_s,
                copy_cpu, copy_s / consolidate_s, copy_cpu / consolidate_cpu);
    std::printf("peak bytes allocated beyond what a rank held: save %ld (target <= shard %ld + largest unit %ld), "
                "load %ld\n", (long)extra[0].item<int64_t>(), (long)shard_bytes, (long)unit_bytes,
                (long)extra[1].item<int64_t>());
    // The load maps the rank files it verifies ([Note: atomic load]): page-cache pages,
    // shared and reclaimable, which a read() also leaves in the page cache.
    std::printf("peak resident growth of a rank during the cold load: %ld (its rank file: %ld bytes, mapped)\n",
                (long)extra[2].item<int64_t>(), (long)extra[3].item<int64_t>());
    // Below 1.0, a "cached" region read part of its input from disk (DAMON pageout on
    // this VM reclaims pages that look idle for 30 s; docs/benchmarks.md).
    std::printf("page-cache residency of the input (least-cached rank): load_cached %.3f, read+crc %.3f, "
                "consolidate %.3f\n", resident[0].item<double>(), resident[1].item<double>(), resident_consolidate);
    // Memory the VM handed back to the host during a region is memory a cold read may have
    // to fault back in ([Note: settle before cold regions]).
    if (vm_mib[0] >= 0)
      std::printf("MiB this VM reported free to its host during each region (settle %ld ms): save %.0f, load_cold %.0f, "
                  "load_cached %.0f, write %.0f, read %.0f, read+crc %.0f\n", (long)settle_ms, vm_mib[0], vm_mib[1],
                  vm_mib[2], vm_mib[3], vm_mib[4], vm_mib[5]);
    for (const auto& r : rows)
      std::printf("{\"op\": \"%s\", \"ranks\": %d, \"bytes\": %ld, \"seconds\": %.4f, \"gb_s\": %.4f, "
                  "\"cpu_seconds\": %.4f, \"baseline\": \"%s\", \"baseline_seconds\": %.4f, "
                  "\"baseline_gb_s\": %.4f, \"baseline_cpu_seconds\": %.4f, \"ratio\": %.3f, \"cpu_ratio\": %.3f, "
                  "\"settle_ms\": %ld, \"vm_reported_mib\": %.0f, \"baseline_vm_reported_mib\": %.0f}\n",
                  r.op, world, (long)bytes, r.s, gb / r.s, r.cpu, r.base, r.bs, gb / r.bs, r.bcpu, r.bs / r.s,
                  r.bcpu / r.cpu, (long)settle_ms, r.vm, r.bvm);
    std::printf("{\"op\": \"consolidate\", \"ranks\": 1, \"bytes\": %ld, \"seconds\": %.4f, \"gb_s\": %.4f, "
                "\"cpu_seconds\": %.4f, \"baseline\": \"read+write+fsync\", \"baseline_seconds\": %.4f, "
                "\"baseline_gb_s\": %.4f, \"baseline_cpu_seconds\": %.4f, \"ratio\": %.3f, \"cpu_ratio\": %.3f}\n",
                (long)consolidated, consolidate_s, consolidated / 1e9 / consolidate_s, consolidate_cpu, copy_s,
                consolidated / 1e9 / copy_s, copy_cpu, copy_s / consolidate_s, copy_cpu / consolidate_cpu);
  }

  // 5. Repetitions: the same two loads and their baselines, in the same order as
  // above (each load straight before its own baseline's cold/cached pair would
  // give the baseline a warmer machine), one JSON line per op and repetition.
  const int reps = std::stoi(arg(argc, argv, "--reps", "1"));
  for (int rep = 2; rep <= reps; ++rep) {
    cpu.clear();
    vm_mib.clear();
    evict(my_file);
    if (rank == 0) evict(dir + "/ckpt/metadata.json");
    const double lc = timed([&] { load_checkpoint(dir + "/ckpt", *model, &opt); }, true);
    const double la = timed([&] { load_checkpoint(dir + "/ckpt", *model, &opt); }, false);
    evict(plain);
    const double rc = timed([&] { plain_read(plain, buf, my_bytes, false); }, true);
    const double ra = timed([&] { plain_read(plain, buf, my_bytes, true); }, false);
    auto rc_all = torch::tensor(cpu, torch::kDouble);
    comm::all_reduce(pg, rc_all).wait();
    const auto rcpu = rc_all.accessor<double, 1>();
    if (rank == 0) {
      const double gb = bytes / 1e9;
      const struct { const char* op; double s, c; const char* base; double bs, bc, vm, bvm; } rows2[] = {
          {"load_cold", lc, rcpu[0], "read", rc, rcpu[2], vm_mib[0], vm_mib[2]},
          {"load_cached", la, rcpu[1], "read+crc", ra, rcpu[3], vm_mib[1], vm_mib[3]}};
      for (const auto& r : rows2)
        std::printf("{\"op\": \"%s\", \"rep\": %d, \"ranks\": %d, \"bytes\": %ld, \"seconds\": %.4f, \"gb_s\": %.4f, "
                    "\"cpu_seconds\": %.4f, \"baseline\": \"%s\", \"baseline_seconds\": %.4f, "
                    "\"baseline_gb_s\": %.4f, \"baseline_cpu_seconds\": %.4f, \"ratio\": %.3f, \"cpu_ratio\": %.3f, "
                    "\"settle_ms\": %ld, \"vm_reported_mib\": %.0f, \"baseline_vm_reported_mib\": %.0f}\n",
                    r.op, rep, world, (long)bytes, r.s, gb / r.s, r.c, r.base, r.bs, gb / r.bs, r.bc, r.bs / r.s,
                    r.bc / r.c, (long)settle_ms, r.vm, r.bvm);
      std::fflush(stdout);
    }
  }
  data = at::Tensor();
  comm::barrier(pg);
  if (rank == 0) fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  check_args(argc, argv);
  if (std::getenv("RANK") == nullptr)
    return fsdp::bench::exec_under_launcher("bench_checkpoint", std::stoi(arg(argc, argv, "--nproc", "4")),
                                            std::vector<std::string>(argv + 1, argv + argc));
  // Compare the CRC-32 implementations (docs/benchmarks.md).
  if (std::getenv("FSDP_CKPT_ZLIB_CRC")) fsdp::state::detail::set_checkpoint_crc_zlib(true);
  try {
    return rank_main(argc, argv);
  } catch (const c10::Error& e) {
    fsdp::tools::print_exception("bench_checkpoint", e, "FAILED: ");
    return 1;
  } catch (const std::exception& e) {
    fsdp::tools::print_exception("bench_checkpoint", e, "FAILED: ");
    return 1;
  }
}
