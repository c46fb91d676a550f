// Clocks, the VM's settling and the plain-I/O baseline shared by the checkpoint benchmarks (bench_checkpoint,
// bench_async_checkpoint). Header-only: benchmarks link the library, not each other.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <cstdint>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp {
namespace bench {

/// CPU seconds (user + system, all threads) this process has used: the cost per byte, which
/// a loaded machine disturbs far less than the wall clock.
inline double cpu_now() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Plain I/O of one file, in 8 MiB calls, then fsync: the baseline a checkpoint save is held to.
inline void plain_write(const std::string& path, const char* data, int64_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(fd >= 0, "bench: cannot create ", path);
  for (int64_t done = 0; done < n;) {
    const ssize_t w = ::write(fd, data + done, std::min<int64_t>(n - done, 8 << 20));
    TORCH_CHECK(w > 0, "bench: writing ", path, " failed");
    done += w;
  }
  TORCH_CHECK(::fsync(fd) == 0, "bench: fsync of ", path, " failed");
  ::close(fd);
}

/// A field of /proc/self/status in bytes ("VmRSS", "VmHWM", ...), 0 if absent.
inline int64_t status_bytes(const char* field) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  int64_t kb = 0;
  const size_t n = std::strlen(field);
  while (std::fgets(line, sizeof(line), f))
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') kb = std::atoll(line + n + 1);
  std::fclose(f);
  return kb * 1024;
}

/// Peak resident-set growth while f runs: the process's high-water mark is reset first
/// (clear_refs 5, no root needed for one's own process). Unlike an allocator's count, it
/// includes file pages mapped into the process.
inline int64_t peak_rss_growth(const std::function<void()>& f) {
  const int64_t before = status_bytes("VmRSS");
  if (std::FILE* c = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", c);
    std::fclose(c);
  }
  f();
  return status_bytes("VmHWM") - before;
}

/// Drops a file's pages from the page cache (written back first), so that the next read
/// comes from the disk. A missing file is left alone.
inline void evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// KiB of free guest memory this VM's kernel has handed back to the host so far (free page
// reporting to the balloon device; a counter of the page_reporting module on the VMs this
// project is measured on), -1 where there is no such counter. A page handed back costs a host
// fault when the guest next touches it, and a cold read's page cache is such fresh memory.
inline int64_t vm_reported_kib() {
  std::FILE* f = std::fopen("/sys/module/page_reporting/parameters/reported_kib", "r");
  if (!f) return -1;
  long long kib = -1;
  if (std::fscanf(f, "%lld", &kib) != 1) kib = -1;
  std::fclose(f);
  return kib;
}

// [Note: settle before cold regions]
// Every cold region starts right after its input was evicted, which frees a rank file's worth
// of page cache per rank. On a VM with free page reporting (the balloon device of the VMs
// this project is measured on), the guest hands free memory back to the host in passes that
// start ~2 s after enough memory was freed (Linux's PAGE_REPORTING_DELAY), and the guest's
// first touch of a page handed back costs a host fault: measured here (anonymous memory,
// fault + zero-fill) ~5.5-6.3 us per 4 KiB
// page against ~2.9-3.4 us for a page freed a moment ago. A cold read's page cache is such
// first-touched memory, whether it is read through read() or through a mapping. In the old
// back-to-back order, which region paid it depended on the bench's own timing (where the
// passes landed, and whether a region's page cache came from memory freed just before or
// from memory handed back earlier): most often the first cold load of a run, sometimes a
// later load or a plain read (docs/benchmarks.md, "first cold load"). So before every cold
// region (save, load, write, read) the bench waits until the VM has stopped reporting (its
// counter unchanged for settle_ms, at most 5x that; settle_ms where there is no counter):
// a load and its baseline then start from the same state, as a resume does that loads a
// checkpoint long after its pages left the page cache. --settle-ms 0 restores the old
// back-to-back order (to compare with older builds).
inline void settle(int64_t settle_ms) {
  if (settle_ms <= 0) return;
  const auto step = std::chrono::milliseconds(100);
  int64_t last = vm_reported_kib(), quiet_ms = 0, waited_ms = 0;
  if (last < 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
    return;
  }
  while (quiet_ms < settle_ms && waited_ms < 5 * settle_ms) {
    std::this_thread::sleep_for(step);
    waited_ms += 100;
    const int64_t k = vm_reported_kib();
    quiet_ms = k == last ? quiet_ms + 100 : 0;
    last = k;
  }
}

}  // namespace bench
}  // namespace fsdp
