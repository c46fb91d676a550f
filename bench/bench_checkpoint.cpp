// bench_checkpoint: 4 ranks save and load a sharded checkpoint of a ~100M-parameter
// model with Adam state, against a plain sequential write + read of the same bytes
// per rank (both fsync'd, both evicted from the page cache before reading with
// posix_fadvise(DONTNEED), which works on clean pages without root).
//
//   bench_checkpoint [--params N] [--dir DIR] [--nproc P]
//
// Without RANK in the environment it re-executes itself under fsdp-run (same bin
// directory). Prints a table and JSON lines {op, bytes, seconds, gb_s, disk_gb_s}
// (bytes: all ranks together; disk_gb_s: the plain write/read of the same bytes).
// Also reports the bytes allocated on each rank during save beyond what it held
// (target: <= its shard + the largest unit; the save makes no copies).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "common/tool_error.h"
#include "fsdp/dist/collectives.h"
#include "fsdp/fsdp/fully_sharded.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/checkpoint_testing.h"
#include "harness/counting_allocator.h"  // header-only; the benchmark does not link the harness

using namespace fsdp;
namespace fs = std::filesystem;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void evict_dir(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir)) evict(e.path().string());
}

const char* kUsage =
    "usage: bench_checkpoint [--params N] [--dir DIR] [--nproc P]\n"
    "  --params N   model size in parameters (default 100000000)\n"
    "  --dir DIR    where the checkpoint and the plain files go (default /tmp)\n"
    "  --nproc P    ranks started under fsdp-run (default 4)\n";

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
    if (a != "--params" && a != "--dir" && a != "--nproc") why = "unknown argument '" + a + "'";
    else if (i + 1 >= argc) why = a + " needs a value";
    else if (a != "--dir") {
      const std::string v = argv[++i];
      char* end = nullptr;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 1) why = a + " expects a positive integer, got '" + v + "'";
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
  auto* counter = fsdp::testing::install_counting_allocator();
  const int64_t target = std::stoll(arg(argc, argv, "--params", "100000000"));
  const std::string dir = arg(argc, argv, "--dir", "/tmp") + "/bench_checkpoint";
  auto pg = dist::init_process_group(dist::InitOptions());
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
  dist::barrier(pg);
  // 1. Checkpoint save (the timed region includes every rank's fsync and the rename).
  const int64_t live_before = counter->live();
  counter->reset_peak();
  dist::barrier(pg);
  double t0 = now();
  save_checkpoint(dir + "/ckpt", *model, &opt);
  dist::barrier(pg);
  const double save_s = now() - t0;
  const int64_t save_extra = counter->peak() - live_before;
  int64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(dir + "/ckpt"))
    if (e.path().extension() == ".bin") bytes += static_cast<int64_t>(e.file_size());
  char name[64];
  std::snprintf(name, sizeof(name), "/ckpt/shard_rank%05d.bin", rank);
  const std::string my_file = dir + name;
  const int64_t my_bytes = fs::exists(my_file) ? static_cast<int64_t>(fs::file_size(my_file)) : 0;

  // 2. Load (same world size), from disk.
  if (rank == 0) evict_dir(dir + "/ckpt");
  dist::barrier(pg);
  t0 = now();
  load_checkpoint(dir + "/ckpt", *model, &opt);
  dist::barrier(pg);
  const double load_s = now() - t0;

  // 3. Plain sequential write + read of the same bytes per rank, in parallel.
  const std::string plain = dir + "/plain_rank" + std::to_string(rank) + ".bin";
  std::vector<char> buf(8 << 20, 1);
  dist::barrier(pg);
  t0 = now();
  {
    const int fd = ::open(plain.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (int64_t left = my_bytes; left > 0;) {
      const ssize_t w = ::write(fd, buf.data(), std::min<int64_t>(left, buf.size()));
      if (w <= 0) break;
      left -= w;
    }
    ::fsync(fd);
    ::close(fd);
  }
  dist::barrier(pg);
  const double disk_write_s = now() - t0;
  evict(plain);
  dist::barrier(pg);
  t0 = now();
  {
    const int fd = ::open(plain.c_str(), O_RDONLY);
    while (::read(fd, buf.data(), buf.size()) > 0) {
    }
    ::close(fd);
  }
  dist::barrier(pg);
  const double disk_read_s = now() - t0;

  auto extra = torch::tensor({save_extra}, torch::kLong);
  dist::all_reduce(pg, extra, dist::ReduceOp::Max).wait();
  if (rank == 0) {
    const double gb = bytes / 1e9;
    std::printf("bench_checkpoint: %d ranks, %d layers of %ldx%ld, %.1fM parameters, Adam state; %.2f GB on disk "
                "in %s\n", world, layers, (long)d, (long)d, numel / 1e6, gb, dir.c_str());
    std::printf("%-10s %10s %10s %12s %10s\n", "op", "seconds", "GB/s", "disk GB/s", "ratio");
    std::printf("%-10s %10.3f %10.3f %12.3f %10.2f\n", "save", save_s, gb / save_s, gb / disk_write_s,
                disk_write_s / save_s);
    std::printf("%-10s %10.3f %10.3f %12.3f %10.2f\n", "load", load_s, gb / load_s, gb / disk_read_s,
                disk_read_s / load_s);
    std::printf("peak bytes allocated during save beyond what a rank held: %ld (target <= shard %ld + largest "
                "unit %ld)\n", (long)extra.item<int64_t>(), (long)shard_bytes, (long)unit_bytes);
    std::printf("{\"op\": \"save\", \"bytes\": %ld, \"seconds\": %.4f, \"gb_s\": %.4f, \"disk_gb_s\": %.4f}\n",
                (long)bytes, save_s, gb / save_s, gb / disk_write_s);
    std::printf("{\"op\": \"load\", \"bytes\": %ld, \"seconds\": %.4f, \"gb_s\": %.4f, \"disk_gb_s\": %.4f}\n",
                (long)bytes, load_s, gb / load_s, gb / disk_read_s);
  }
  dist::barrier(pg);
  if (rank == 0) fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  check_args(argc, argv);
  if (std::getenv("RANK") == nullptr) {
    // Re-execute under fsdp-run from the same bin directory.
    const std::string self = fs::read_symlink("/proc/self/exe").string();
    const std::string launcher = self.substr(0, self.rfind('/')) + "/fsdp-run";
    const std::string nproc = arg(argc, argv, "--nproc", "4");
    std::vector<std::string> a{launcher, "--nproc", nproc, "--", self};
    for (int i = 1; i < argc; ++i) a.push_back(argv[i]);
    std::vector<char*> c;
    for (auto& s : a) c.push_back(s.data());
    c.push_back(nullptr);
    ::execv(launcher.c_str(), c.data());
    std::fprintf(stderr, "bench_checkpoint: cannot execute %s (build target fsdp-run)\n", launcher.c_str());
    return 1;
  }
  // Compare the CRC-32 implementations (docs/benchmarks.md).
  if (std::getenv("FSDP_CKPT_ZLIB_CRC")) fsdp::detail::set_checkpoint_crc_zlib(true);
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
