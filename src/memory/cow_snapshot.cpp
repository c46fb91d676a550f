#include "cow_snapshot.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace fsdp::memory {

// Names of this file only, in a named namespace: src/memory builds as one unity source.
namespace cow_detail {

// A page's state in CowSnapshot::pages_. Who moves it:
//   protected --handler--> copying --handler--> copied(slot)   (the page writable again)
//   copying   --handler--> protected                          (side buffer full: wait)
//   protected --writer or release()--> taking --> taken        (the page writable again)
//   copied(slot) --writer--> taken                             (after its chunk's fn)
// A handler waits while a page is copying or taking (and, side buffer full, protected); the
// writer waits only while a page is copying.
constexpr uint32_t kProtected = 0;
constexpr uint32_t kCopying = 1;
constexpr uint32_t kTaking = 2;
constexpr uint32_t kTaken = 3;
constexpr uint32_t kCopiedBase = 4;  // + the side slot holding the copy

// The handler reads these: they must be lock-free to be async-signal-safe.
static_assert(std::atomic<uint32_t>::is_always_lock_free, "page states must be lock-free");
static_assert(std::atomic<size_t>::is_always_lock_free, "the side-slot cursor must be lock-free");
static_assert(std::atomic<int64_t>::is_always_lock_free, "statistics must be lock-free");
static_assert(std::atomic<int>::is_always_lock_free, "registry counters must be lock-free");
static_assert(std::atomic<uintptr_t>::is_always_lock_free, "tombstones must be lock-free");
static_assert(std::atomic<CowSnapshot*>::is_always_lock_free, "the registry must be lock-free");

// The live snapshots. `inside` counts handlers that may be reading `snapshot`; unregistering
// clears the pointer, then waits for it to drop to zero before the snapshot may die.
struct RegistrySlot {
  std::atomic<CowSnapshot*> snapshot;
  std::atomic<int> inside;
};
// The address span of a snapshot released at `released_ns` (0: none; the span runs from its
// lowest region to the end of its highest): a fault the hardware raised before release()
// gave the page back finds no snapshot, and is retried for kRetryReleasedNs.
struct Tombstone {
  std::atomic<int64_t> released_ns;
  std::atomic<uintptr_t> lo;
  std::atomic<uintptr_t> hi;
};

RegistrySlot g_registry[CowSnapshot::kMaxLiveSnapshots];
Tombstone g_tombstones[CowSnapshot::kMaxLiveSnapshots];
std::atomic<unsigned> g_next_tombstone{0};
constexpr int64_t kRetryReleasedNs = 1000 * 1000 * 1000;

// The SIGSEGV disposition found when the handler was installed (written once, before).
struct sigaction g_previous;
std::mutex g_install_mu;
bool g_installed = false;

int64_t now_ns() noexcept {
  struct timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

#ifdef MADV_POPULATE_WRITE
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kPopulateWrite = 23;  // Linux 5.14's value; older kernels refuse it (EINVAL)
#endif

// One short wait of a spin: a handler waiting for the writer, or the writer for a copy.
void backoff() noexcept {
  const struct timespec ts{0, 20 * 1000};
  ::nanosleep(&ts, nullptr);
}

// A handler that cannot change a page's protection cannot make the write succeed.
[[noreturn]] void die(const char* what) noexcept {
  static const char prefix[] = "fsdp::memory::CowSnapshot: ";
  (void)!::write(2, prefix, sizeof(prefix) - 1);
  (void)!::write(2, what, std::strlen(what));
  (void)!::write(2, "\n", 1);
  std::abort();
}

void make_writable(void* addr, size_t bytes) noexcept {
  if (::mprotect(addr, bytes, PROT_READ | PROT_WRITE) != 0) {
    die("mprotect(PROT_READ | PROT_WRITE) failed (too many mappings? see vm.max_map_count)");
  }
}

std::string hex(const void* p) {
  char text[2 + 2 * sizeof(void*) + 1];
  std::snprintf(text, sizeof(text), "%p", p);
  return text;
}

// Appends [p, p + n) to `iov`, extending the last entry when the bytes continue it.
void append_bytes(std::vector<struct iovec>& iov, char* p, size_t n) {
  if (!iov.empty() && static_cast<char*>(iov.back().iov_base) + iov.back().iov_len == p) {
    iov.back().iov_len += n;
    return;
  }
  iov.push_back({p, n});
}

}  // namespace cow_detail

// --- the signal handler and the registry ---------------------------------------------

struct CowFaultHandler {
  static void on_signal(int sig, siginfo_t* info, void* ctx);
  static bool is_write(const void* ctx) noexcept;
  static bool resolve(const void* addr) noexcept;
  static bool released_recently(const void* addr) noexcept;
  static void chain(int sig, siginfo_t* info, void* ctx) noexcept;

  static void install();
  static int register_snapshot(CowSnapshot* snapshot);
  static void unregister(int slot, const CowSnapshot& snapshot) noexcept;
};

void CowFaultHandler::on_signal(int sig, siginfo_t* info, void* ctx) {
  const int saved_errno = errno;  // the interrupted code may be about to read it
  const bool ours = info->si_code == SEGV_ACCERR && is_write(ctx) && resolve(info->si_addr);
  errno = saved_errno;
  if (ours) return;  // the write is retried, on a page now writable
  chain(sig, info, ctx);
  errno = saved_errno;
}

bool CowFaultHandler::is_write(const void* ctx) noexcept {
#if defined(__x86_64__)
  // The page-fault error code's bit 1: the access was a write.
  return (static_cast<const ucontext_t*>(ctx)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#else
  (void)ctx;  // a snapshot's pages are readable: an access fault on one is a write
  return true;
#endif
}

bool CowFaultHandler::resolve(const void* addr) noexcept {
  for (auto& slot : cow_detail::g_registry) {
    slot.inside.fetch_add(1);  // before reading the pointer: unregister waits for it
    CowSnapshot* snapshot = slot.snapshot.load();
    const bool handled = snapshot != nullptr && snapshot->on_write_fault(addr);
    slot.inside.fetch_sub(1);
    if (handled) return true;
  }
  return released_recently(addr);
}

bool CowFaultHandler::released_recently(const void* addr) noexcept {
  const auto a = reinterpret_cast<uintptr_t>(addr);
  const int64_t now = cow_detail::now_ns();
  for (auto& t : cow_detail::g_tombstones) {
    const int64_t at = t.released_ns.load();
    if (at == 0 || now - at > cow_detail::kRetryReleasedNs) continue;
    const uintptr_t lo = t.lo.load();
    const uintptr_t hi = t.hi.load();
    if (t.released_ns.load() != at) continue;  // rewritten meanwhile
    if (a >= lo && a < hi) {
      cow_detail::backoff();  // a genuine fault there retries for kRetryReleasedNs, then chains
      return true;
    }
  }
  return false;
}

void CowFaultHandler::chain(int sig, siginfo_t* info, void* ctx) noexcept {
  const struct sigaction& prev = cow_detail::g_previous;
  const bool sent = info->si_code <= 0;  // kill(), raise(): no instruction to retry
  if (prev.sa_handler == SIG_IGN && sent) return;
  if (prev.sa_handler == SIG_DFL || prev.sa_handler == SIG_IGN) {
    // What the kernel does for a fault whose signal is ignored or default: restore the
    // default and let the fault happen again, so the process dies of it (and dumps core).
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(sig, &dfl, nullptr);
    if (sent) ::raise(sig);  // blocked here: delivered when the handler returns
    return;
  }
  if (prev.sa_flags & SA_SIGINFO) {
    prev.sa_sigaction(sig, info, ctx);
  } else {
    prev.sa_handler(sig);
  }
}

void CowFaultHandler::install() {
  std::lock_guard<std::mutex> lock(cow_detail::g_install_mu);
  struct sigaction current;
  ::sigaction(SIGSEGV, nullptr, &current);
  if (cow_detail::g_installed) {
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == &on_signal) return;
    throw std::runtime_error(
        "fsdp::memory::CowSnapshot: another SIGSEGV handler replaced the copy-on-write "
        "snapshots' handler (installed with the first snapshot), so a snapshot's write faults "
        "would crash; install your handler before the first snapshot: ours chains to it");
  }
  cow_detail::g_previous = current;  // read by the handler: written before it is installed
  struct sigaction ours;
  std::memset(&ours, 0, sizeof(ours));
  ours.sa_sigaction = &on_signal;
  sigemptyset(&ours.sa_mask);
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
  if (::sigaction(SIGSEGV, &ours, nullptr) != 0) {
    const int err = errno;
    throw std::runtime_error(std::string("fsdp::memory::CowSnapshot: cannot install the SIGSEGV handler: ") +
                             std::strerror(err));
  }
  cow_detail::g_installed = true;
}

int CowFaultHandler::register_snapshot(CowSnapshot* snapshot) {
  for (int i = 0; i < CowSnapshot::kMaxLiveSnapshots; ++i) {
    CowSnapshot* expected = nullptr;
    if (cow_detail::g_registry[i].snapshot.compare_exchange_strong(expected, snapshot)) return i;
  }
  throw std::runtime_error("fsdp::memory::CowSnapshot: " + std::to_string(CowSnapshot::kMaxLiveSnapshots) +
                           " snapshots are alive already, the most at once; release() a written one "
                           "before taking another");
}

void CowFaultHandler::unregister(int slot, const CowSnapshot& snapshot) noexcept {
  if (!snapshot.by_address_.empty()) {
    const CowRegion& first = snapshot.regions_[snapshot.by_address_.front()];
    const CowRegion& last = snapshot.regions_[snapshot.by_address_.back()];
    auto& t = cow_detail::g_tombstones[cow_detail::g_next_tombstone.fetch_add(1) % CowSnapshot::kMaxLiveSnapshots];
    t.released_ns.store(0);  // first: a reader that sees the new span sees the new time
    t.lo.store(reinterpret_cast<uintptr_t>(first.base));
    t.hi.store(reinterpret_cast<uintptr_t>(last.base) + last.bytes);
    t.released_ns.store(cow_detail::now_ns());
  }
  auto& entry = cow_detail::g_registry[slot];
  entry.snapshot.store(nullptr);
  while (entry.inside.load() != 0) cow_detail::backoff();
}

// --- construction -----------------------------------------------------------------------

namespace cow_detail {

std::string region_text(size_t i, const CowRegion& r) {
  return "region " + std::to_string(i) + " (" + std::to_string(r.bytes) + " bytes at " + hex(r.base) + ")";
}

void check_options(const CowOptions& options, size_t page) {
  const std::string who = "fsdp::memory::CowSnapshot: chunk_bytes " + std::to_string(options.chunk_bytes);
  if (options.chunk_bytes == 0 || options.chunk_bytes % page != 0) {
    throw std::invalid_argument(who + " is not a positive multiple of the page size " + std::to_string(page));
  }
  if (options.chunk_bytes / page > static_cast<size_t>(IOV_MAX)) {
    throw std::invalid_argument(who + " is more than IOV_MAX (" + std::to_string(IOV_MAX) +
                                ") pages: one chunk's iovecs must fit one writev");
  }
}

void check_region(size_t i, const CowRegion& r, size_t page) {
  const std::string who = "fsdp::memory::CowSnapshot: " + region_text(i, r);
  if (reinterpret_cast<uintptr_t>(r.base) % page != 0) {
    throw std::invalid_argument(who + " does not start on a page boundary (page size " + std::to_string(page) +
                                "); snapshot whole pages of a PageMapping");
  }
  if (r.bytes == 0 || r.bytes % page != 0) {
    throw std::invalid_argument(who + " is not a positive multiple of the page size " + std::to_string(page) +
                                "; snapshot whole pages of a PageMapping (an empty region: leave it out)");
  }
  if (reinterpret_cast<uintptr_t>(r.base) > UINTPTR_MAX - r.bytes) {
    throw std::invalid_argument(who + " runs past the end of the address space");
  }
}

}  // namespace cow_detail

CowSnapshot::CowSnapshot(std::vector<CowRegion> regions, CowOptions options)
    : regions_(std::move(regions)), page_(PageMapping::page_size()), chunk_bytes_(options.chunk_bytes) {
  cow_detail::check_options(options, page_);
  index_regions();
  pages_.reset(new std::atomic<uint32_t>[page_count_]);
  for (size_t i = 0; i < page_count_; ++i) pages_[i].store(cow_detail::kProtected, std::memory_order_relaxed);
  side_slots_ = std::min<size_t>(options.copy_cap_bytes / page_, UINT32_MAX - cow_detail::kCopiedBase);
  side_ = PageMapping(side_slots_ * page_);  // up front: the handler never allocates
  CowFaultHandler::install();
  registry_slot_ = CowFaultHandler::register_snapshot(this);
  protect_regions();  // last: from here on, training's writes fault
}

CowSnapshot::~CowSnapshot() { release(); }

void CowSnapshot::index_regions() {
  first_page_.reserve(regions_.size());
  by_address_.reserve(regions_.size());
  for (size_t i = 0; i < regions_.size(); ++i) {
    cow_detail::check_region(i, regions_[i], page_);
    first_page_.push_back(page_count_);
    page_count_ += regions_[i].bytes / page_;
    by_address_.push_back(i);
  }
  const auto base = [this](size_t i) { return reinterpret_cast<uintptr_t>(regions_[i].base); };
  std::sort(by_address_.begin(), by_address_.end(), [&](size_t a, size_t b) { return base(a) < base(b); });
  for (size_t k = 1; k < by_address_.size(); ++k) {
    const size_t a = by_address_[k - 1];
    const size_t b = by_address_[k];
    if (base(a) + regions_[a].bytes > base(b)) {
      throw std::invalid_argument("fsdp::memory::CowSnapshot: " + cow_detail::region_text(a, regions_[a]) + " and " +
                                  cow_detail::region_text(b, regions_[b]) +
                                  " overlap; each page may be in one region only");
    }
  }
}

void CowSnapshot::protect_regions() {
  const int64_t start = cow_detail::now_ns();
  for (size_t i = 0; i < regions_.size(); ++i) {
    if (::mprotect(regions_[i].base, regions_[i].bytes, PROT_READ) == 0) continue;
    const int err = errno;
    // Undo: the regions protected so far (and any part of this one) are writable again.
    for (size_t j = 0; j <= i; ++j) cow_detail::make_writable(regions_[j].base, regions_[j].bytes);
    released_.store(true);
    CowFaultHandler::unregister(registry_slot_, *this);
    throw std::runtime_error("fsdp::memory::CowSnapshot: mprotect(PROT_READ) of " +
                             cow_detail::region_text(i, regions_[i]) + " failed: " + std::strerror(err) +
                             (err == ENOMEM ? " (too many mappings? see vm.max_map_count)" : ""));
  }
  protect_ns_.store(cow_detail::now_ns() - start);
}

// --- the fault (training threads, in the signal handler) ----------------------------------

bool CowSnapshot::on_write_fault(const void* addr) noexcept {
  const auto a = reinterpret_cast<uintptr_t>(addr);
  // The last region starting at or below `a`, then whether `a` is inside it.
  const auto after = std::upper_bound(by_address_.begin(), by_address_.end(), a, [this](uintptr_t x, size_t i) {
    return x < reinterpret_cast<uintptr_t>(regions_[i].base);
  });
  if (after == by_address_.begin()) return false;
  const size_t r = *(after - 1);
  const uintptr_t offset = a - reinterpret_cast<uintptr_t>(regions_[r].base);
  if (offset >= regions_[r].bytes) return false;

  const int64_t start = cow_detail::now_ns();
  const size_t in_region = offset / page_;
  const size_t chunk_pages = chunk_bytes_ / page_;
  const size_t to_chunk_end = std::min(chunk_pages - in_region % chunk_pages, regions_[r].bytes / page_ - in_region);
  resolve_fault(first_page_[r] + in_region, static_cast<char*>(regions_[r].base) + in_region * page_, to_chunk_end);
  faults_.fetch_add(1, std::memory_order_relaxed);
  fault_ns_.fetch_add(cow_detail::now_ns() - start, std::memory_order_relaxed);
  return true;
}

void CowSnapshot::resolve_fault(size_t page, char* addr, size_t limit) noexcept {
  for (;;) {
    uint32_t state = pages_[page].load(std::memory_order_acquire);
    if (state == cow_detail::kTaken || state >= cow_detail::kCopiedBase) return;  // writable
    const bool room = next_slot_.load(std::memory_order_relaxed) < side_slots_;
    if (state == cow_detail::kProtected && room &&
        pages_[page].compare_exchange_strong(state, cow_detail::kCopying, std::memory_order_acq_rel)) {
      const size_t run = claim_run(page, limit);
      size_t slot = 0;
      const size_t got = reserve_slots(run, &slot);
      for (size_t k = got; k < run; ++k) {  // no room for these (or any): they stay protected
        pages_[page + k].store(cow_detail::kProtected, std::memory_order_release);
      }
      if (got > 0) {
        copy_pages(page, addr, got, slot);
        return;
      }
    }
    const int64_t waited_from = cow_detail::now_ns();
    cow_detail::backoff();  // copying (another thread), taking (the writer), or no room
    wait_ns_.fetch_add(cow_detail::now_ns() - waited_from, std::memory_order_relaxed);
  }
}

size_t CowSnapshot::claim_run(size_t page, size_t limit) noexcept {
  size_t run = 1;  // `page` itself, claimed by the caller
  for (; run < limit; ++run) {
    uint32_t expected = cow_detail::kProtected;
    if (!pages_[page + run].compare_exchange_strong(expected, cow_detail::kCopying, std::memory_order_acq_rel)) {
      break;
    }
  }
  return run;
}

size_t CowSnapshot::reserve_slots(size_t wanted, size_t* slot) noexcept {
  size_t next = next_slot_.load(std::memory_order_relaxed);
  while (next < side_slots_) {
    const size_t got = std::min(wanted, side_slots_ - next);
    if (next_slot_.compare_exchange_weak(next, next + got, std::memory_order_relaxed)) {
      *slot = next;
      return got;
    }
  }
  return 0;
}

void CowSnapshot::copy_pages(size_t page, char* addr, size_t count, size_t slot) noexcept {
  char* const to = static_cast<char*>(side_.data()) + slot * page_;
  // The side buffer is mapped, not yet backed: one call backs the slots instead of a page
  // fault per page inside the memcpy. Where the kernel lacks it, the memcpy faults them in.
  (void)::madvise(to, count * page_, cow_detail::kPopulateWrite);
  std::memcpy(to, addr, count * page_);
  cow_detail::make_writable(addr, count * page_);
  pages_copied_.fetch_add(static_cast<int64_t>(count), std::memory_order_relaxed);
  // Release: the writer that sees a slot sees its copy.
  for (size_t k = 0; k < count; ++k) {
    pages_[page + k].store(cow_detail::kCopiedBase + static_cast<uint32_t>(slot + k), std::memory_order_release);
  }
}

// --- the writer -------------------------------------------------------------------------

// One chunk's pages in the writer's hands: the first `claimed` of `count` pages from
// `first_page` (at `base`) are claimed; give_back_chunk() makes exactly those taken.
struct CowSnapshot::Range {
  size_t first_page;
  size_t count;
  char* base;
  size_t claimed;
};

void CowSnapshot::take(size_t region, size_t offset, size_t bytes, const ChunkFn& fn) {
  check_take(region, offset, bytes);
  char* const base = static_cast<char*>(regions_[region].base);
  const size_t end = offset + bytes;
  for (size_t at = offset; at < end;) {
    const size_t chunk_end = std::min(end, (at / chunk_bytes_ + 1) * chunk_bytes_);
    Range range{first_page_[region] + at / page_, (chunk_end - at) / page_, base + at, 0};
    take_chunk(range, fn);
    at = chunk_end;
  }
}

void CowSnapshot::check_take(size_t region, size_t offset, size_t bytes) const {
  const std::string who = "fsdp::memory::CowSnapshot::take: ";
  if (released_.load()) throw std::logic_error(who + "the snapshot was released");
  if (region >= regions_.size()) {
    throw std::invalid_argument(who + "region " + std::to_string(region) + " of " +
                                std::to_string(regions_.size()));
  }
  const CowRegion& r = regions_[region];
  const std::string range = cow_detail::region_text(region, r) + ", bytes [" + std::to_string(offset) + ", " +
                            std::to_string(offset + bytes) + ")";
  if (offset % page_ != 0 || bytes % page_ != 0 || bytes == 0 || offset > r.bytes || bytes > r.bytes - offset) {
    throw std::invalid_argument(who + range + ": not a non-empty range of whole pages (" + std::to_string(page_) +
                                " bytes) inside the region");
  }
  for (size_t p = 0; p < bytes / page_; ++p) {
    const uint32_t state = pages_[first_page_[region] + offset / page_ + p].load(std::memory_order_acquire);
    if (state == cow_detail::kTaking || state == cow_detail::kTaken) {
      throw std::logic_error(who + range + ": the page at byte " + std::to_string(offset + p * page_) +
                             " was taken already; each page is taken once");
    }
  }
}

void CowSnapshot::take_chunk(Range& range, const ChunkFn& fn) {
  // Whatever happens below, the claimed pages go back to training: a fault on one waits.
  struct GiveBack {
    CowSnapshot* self;
    Range* range;
    ~GiveBack() { self->give_back_chunk(*range); }
  } give_back{this, &range};

  std::vector<struct iovec> iov;
  iov.reserve(range.count);
  char* const side = static_cast<char*>(side_.data());
  for (; range.claimed < range.count; ++range.claimed) {
    const uint32_t state = claim_page(range.first_page + range.claimed);
    char* src = state == cow_detail::kTaking ? range.base + range.claimed * page_
                                             : side + (state - cow_detail::kCopiedBase) * page_;
    cow_detail::append_bytes(iov, src, page_);
  }
  fn(iov.data(), static_cast<int>(iov.size()));
}

uint32_t CowSnapshot::claim_page(size_t page) {
  for (;;) {
    uint32_t state = pages_[page].load(std::memory_order_acquire);
    if (state >= cow_detail::kCopiedBase) return state;  // the side copy is the snapshot's
    if (state == cow_detail::kProtected) {
      if (pages_[page].compare_exchange_strong(state, cow_detail::kTaking, std::memory_order_acq_rel)) {
        return cow_detail::kTaking;
      }
      continue;
    }
    if (state == cow_detail::kCopying) {
      cow_detail::backoff();  // a handler's memcpy and mprotect: no wait inside
      continue;
    }
    throw std::logic_error(
        "fsdp::memory::CowSnapshot::take: a page was taken meanwhile (two takes of one range at "
        "once, or a take during release())");
  }
}

void CowSnapshot::give_back_chunk(const Range& range) {
  // Runs of pages still protected become writable, one mprotect each; then all are taken.
  for (size_t k = 0; k < range.claimed;) {
    if (pages_[range.first_page + k].load(std::memory_order_relaxed) != cow_detail::kTaking) {
      ++k;
      continue;
    }
    size_t end = k + 1;
    while (end < range.claimed &&
           pages_[range.first_page + end].load(std::memory_order_relaxed) == cow_detail::kTaking) {
      ++end;
    }
    cow_detail::make_writable(range.base + k * page_, (end - k) * page_);
    k = end;
  }
  for (size_t k = 0; k < range.claimed; ++k) {
    pages_[range.first_page + k].store(cow_detail::kTaken, std::memory_order_release);
  }
}

// --- release ----------------------------------------------------------------------------

void CowSnapshot::release() {
  if (released_.exchange(true)) return;
  give_back_all();
  CowFaultHandler::unregister(registry_slot_, *this);
}

void CowSnapshot::give_back_all() {
  // Claim every page still protected (waiting out copies and the writer's chunk in hand),
  // make each region writable at once, then mark the claimed pages taken: a handler
  // waiting for one of them returns to a writable page.
  for (size_t p = 0; p < page_count_; ++p) {
    for (;;) {
      uint32_t state = pages_[p].load(std::memory_order_acquire);
      if (state == cow_detail::kTaken || state >= cow_detail::kCopiedBase) break;
      if (state == cow_detail::kProtected &&
          pages_[p].compare_exchange_strong(state, cow_detail::kTaking, std::memory_order_acq_rel)) {
        break;
      }
      cow_detail::backoff();
    }
  }
  for (const CowRegion& r : regions_) cow_detail::make_writable(r.base, r.bytes);
  for (size_t p = 0; p < page_count_; ++p) {
    if (pages_[p].load(std::memory_order_relaxed) == cow_detail::kTaking) {
      pages_[p].store(cow_detail::kTaken, std::memory_order_release);
    }
  }
}

CowStats CowSnapshot::stats() const {
  CowStats s;
  s.pages_copied = pages_copied_.load(std::memory_order_relaxed);
  s.copy_bytes = s.pages_copied * static_cast<int64_t>(page_);
  s.faults = faults_.load(std::memory_order_relaxed);
  s.fault_ns = fault_ns_.load(std::memory_order_relaxed);
  s.wait_ns = wait_ns_.load(std::memory_order_relaxed);
  s.protect_ns = protect_ns_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace fsdp::memory
