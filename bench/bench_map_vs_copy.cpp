// Feasibility probe for a zero-copy all-gather over shared memory (docs/benchmarks.md,
// "What is left of the step"): can a rank map a peer's shard pages into its unsharded
// buffer instead of copying them, and what does it cost?
//
// Per buffer size, with the source out of cache each time (96 MB streamed between
// iterations, as the step's other traffic does), it times:
//   copy: memcpy the peer's bytes into a private buffer, then read them (what the
//         forward's gemm does with a gathered unit today);
//   map:  mmap(MAP_FIXED | MAP_SHARED | MAP_POPULATE) the peer's file range over a
//         reserved address range, read it (cold: nothing copied it into cache), then
//         drop the mapping (PROT_NONE over it, the reservation kept).
// One process; the "peer" is a memfd it filled. Torch-free, so it builds in a second.
//
//   build/bin/bench_map_vs_copy [--reps N] [--hugetlb]
// --hugetlb backs the "peer" file with 2 MB pages (memfd MFD_HUGETLB; needs
// /proc/sys/vm/nr_hugepages >= 40) and times only sizes of whole huge pages.
// prints one JSON line per size: copy_us, map_us (map + read + unmap), map_only_us,
// read_after_copy_us, read_after_map_us, and map_vs_copy (< 1: mapping is cheaper).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/tool_error.h"

namespace {

using clock_type = std::chrono::steady_clock;

double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

bool g_huge = false;

[[noreturn]] void die(const char* what) {
  std::string msg = std::string(what) + " failed: " + std::strerror(errno);
  if (g_huge) msg += " (--hugetlb needs 2 MB pages reserved: echo 40 > /proc/sys/vm/nr_hugepages)";
  fsdp::tools::print_error("bench_map_vs_copy", msg);
  std::exit(1);
}

// A read of every cache line, as a consumer of the buffer would (the sum keeps it live).
uint64_t read_all(const char* p, size_t n) {
  uint64_t s = 0;
  for (size_t i = 0; i < n; i += 64) s += static_cast<unsigned char>(p[i]);
  return s;
}

// Streams through `n` bytes so that earlier data leaves the caches (L3 is 32 MB here).
void evict(std::vector<char>& junk) {
  for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 40;
  bool huge = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (std::string(argv[i]) == "--hugetlb") {
      huge = g_huge = true;
    } else {
      fsdp::tools::print_error("bench_map_vs_copy", "usage: bench_map_vs_copy [--reps N] [--hugetlb]");
      return 2;
    }
  }
  const size_t file_bytes = size_t(64) << 20;
  const int fd = memfd_create("map_vs_copy", huge ? MFD_HUGETLB : 0);
  if (fd < 0) die("memfd_create");
  if (ftruncate(fd, static_cast<off_t>(file_bytes)) != 0) die("ftruncate");
  char* peer = static_cast<char*>(mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  if (peer == MAP_FAILED) die("mmap peer");
  for (size_t i = 0; i < file_bytes; ++i) peer[i] = static_cast<char>(i * 7);
  std::vector<char> junk(size_t(96) << 20, 1);
  uint64_t sink = 0;
  const size_t page = huge ? size_t(2) << 20 : 4096;
  for (size_t bytes : {size_t(64) << 10, size_t(256) << 10, size_t(2) << 20, size_t(8) << 20}) {
    if (bytes % page) continue;
    std::vector<char> dst(bytes, 0);  // the private unsharded buffer (kept: pooled, no faults)
    // Reserved with room to align it to the page size (hugetlb mappings must be).
    char* raw = static_cast<char*>(mmap(nullptr, bytes + page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (raw == MAP_FAILED) die("mmap reserve");
    char* reserved = raw + (page - reinterpret_cast<uintptr_t>(raw) % page) % page;
    std::vector<double> copy_us, read_copy_us, map_us, map_only_us, read_map_us;
    for (int r = 0; r < reps; ++r) {
      // A different part of the peer file each time, as each unit's shard is.
      const size_t off = (static_cast<size_t>(r) * bytes) % (file_bytes - bytes) / page * page;
      evict(junk);
      auto t0 = clock_type::now();
      std::memcpy(dst.data(), peer + off, bytes);
      const double c = us_since(t0);
      auto t1 = clock_type::now();
      sink += read_all(dst.data(), bytes);
      const double rc = us_since(t1);
      copy_us.push_back(c + rc);
      read_copy_us.push_back(rc);

      evict(junk);
      auto t2 = clock_type::now();
      void* m = mmap(reserved, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd,
                     static_cast<off_t>(off));
      if (m == MAP_FAILED) die("mmap fixed");
      const double mo = us_since(t2);
      auto t3 = clock_type::now();
      sink += read_all(reserved, bytes);
      const double rm = us_since(t3);
      auto t4 = clock_type::now();
      if (mmap(reserved, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
        die("mmap unreserve");
      const double um = us_since(t4);
      map_us.push_back(mo + rm + um);
      map_only_us.push_back(mo + um);
      read_map_us.push_back(rm);
    }
    munmap(raw, bytes + page);
    std::printf(
        "{\"bytes\": %zu, \"copy_us\": %.1f, \"map_us\": %.1f, \"map_only_us\": %.1f, \"read_after_copy_us\": %.1f, "
        "\"read_after_map_us\": %.1f, \"map_vs_copy\": %.3f}\n",
        bytes, median(copy_us), median(map_us), median(map_only_us), median(read_copy_us), median(read_map_us),
        median(map_us) / median(copy_us));
  }
  std::fprintf(stderr, "(checksum %llu)\n", static_cast<unsigned long long>(sink));
  return 0;
}
