// [Note: exchange arena]
// The shared-memory channel (shm_channel.cpp) moves a collective's bytes through rings:
// the writer copies its data into a slot and each reader copies it out, two copies per
// byte. When the data already lies in memory its readers have mapped, the writer can
// publish where it is instead, and each reader copies it once, straight into its own
// output (or sums it straight from there). That memory is this arena: one per process,
// a shared-memory file every channel's peers map. FSDP allocates the buffers its
// collectives read (the unsharded parameters, whose own chunk is gathered, and the flat
// gradients, which are reduce-scattered) from it through
// comm::allocate_collective_buffer; any other tensor takes the copying path as before.
//
// Layout: a page of header (magic, nonce), then blocks carved first-fit from a free
// list, page-aligned. The file is kArenaBytes long but sparse: a block's pages are
// reserved (fallocate) when it is handed out and punched out when it is freed, so the
// arena holds only live blocks. Peers map the whole length without reserving anything.
//
// Opening: the owner unlinks the file at once (a crash leaves nothing in /dev/shm) and
// keeps its descriptor; peers open it through /proc/<pid>/fd/<fd>, which needs what
// reading the peer's /proc entries needs (same user), and check the nonce in its header.
// A peer that cannot open it makes the channel keep copying through its rings (the
// members agree on this when the channel is set up).
//
// Lifetime: a block's DataPtr keeps the arena alive; peers' mappings are held by the
// channels that read them, so a reader never faults on a block its writer freed (it
// would read stale bytes, which the channel's protocol rules out: a writer completes an
// operation only after every reader released the fragments it published in place).
#include "shm_arena.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

namespace {

constexpr uint64_t kArenaMagic = 0x3161726170647366ull;  // "fsdpara1"
constexpr int64_t kPage = kArenaPage;
// Virtual length: larger than any set of FSDP buffers alive at once on one host. Costs
// address space only (MAP_NORESERVE, sparse file).
constexpr int64_t kArenaBytes = int64_t(64) << 30;

struct ArenaHeader {
  uint64_t magic;
  uint64_t nonce;
  int64_t bytes;
};

struct Lease {
  std::shared_ptr<ShmArena> arena;
  int64_t off, len;
  int64_t counted;  // bytes asked for: what a CPU allocator's counter would count
};

// Accounting of live blocks (comm::collective_buffer_bytes and its observers).
std::atomic<int64_t> g_live{0};
std::mutex g_observers_mu;
std::vector<void (*)(int64_t)>& observers() {
  static std::vector<void (*)(int64_t)> v;
  return v;
}
void account(int64_t delta) {
  g_live += delta;
  std::lock_guard<std::mutex> lock(g_observers_mu);
  for (auto* f : observers()) f(delta);
}

char* map_file(int fd, int64_t bytes) {
  void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

}  // namespace

std::shared_ptr<ShmArena> ShmArena::create(std::string* why) {
  std::random_device rd;
  const uint64_t nonce = (uint64_t(rd()) << 32) ^ rd();
  std::ostringstream os;
  os << "/fsdp.arena." << ::getpid() << "." << std::hex << nonce;
  const std::string name = os.str();
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why = std::string("shm_open: ") + std::strerror(errno);
    return nullptr;
  }
  ::shm_unlink(name.c_str());
  int err = ::ftruncate(fd, kArenaBytes) == 0 ? 0 : errno;
  if (err == 0) err = ::posix_fallocate(fd, 0, kPage);
  char* base = err == 0 ? map_file(fd, kArenaBytes) : nullptr;
  if (err == 0 && base == nullptr) err = errno;
  if (err != 0) {
    ::close(fd);
    *why = std::string("cannot create the exchange arena in /dev/shm: ") + std::strerror(err);
    return nullptr;
  }
  std::shared_ptr<ShmArena> a(new ShmArena(fd, /*owner=*/true, nonce, base));
  a->free_[kPage] = kArenaBytes - kPage;
  auto* h = reinterpret_cast<ArenaHeader*>(base);
  h->nonce = nonce;
  h->bytes = kArenaBytes;
  __atomic_store_n(&h->magic, kArenaMagic, __ATOMIC_RELEASE);
  return a;
}

std::shared_ptr<ShmArena> ShmArena::open(int pid, int fd, uint64_t nonce, std::string* why) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int my = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (my < 0) {
    *why = "cannot open the peer's exchange arena " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat st {};
  if (::fstat(my, &st) != 0 || st.st_size != kArenaBytes) {
    ::close(my);
    *why = path + " is not a peer's exchange arena (size " + std::to_string(st.st_size) + ")";
    return nullptr;
  }
  char* base = map_file(my, kArenaBytes);
  if (base == nullptr) {
    *why = "cannot map " + path + ": " + std::strerror(errno);
    ::close(my);
    return nullptr;
  }
  std::shared_ptr<ShmArena> a(new ShmArena(my, /*owner=*/false, nonce, base));
  const auto* h = reinterpret_cast<const ArenaHeader*>(base);
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != kArenaMagic || h->nonce != nonce || h->bytes != kArenaBytes) {
    *why = path + " is not the peer's exchange arena (another PID namespace, or a recycled pid?)";
    return nullptr;  // a's destructor unmaps and closes
  }
  return a;
}

ShmArena::ShmArena(int fd, bool owner, uint64_t nonce, char* base)
    : fd_(fd), owner_(owner), nonce_(nonce), base_(base), bytes_(kArenaBytes) {}

ShmArena::~ShmArena() {
  if (base_) ::munmap(base_, static_cast<size_t>(bytes_));
  if (fd_ >= 0) ::close(fd_);
}

int64_t ShmArena::offset_of(const void* p, int64_t len) const {
  const char* c = static_cast<const char*>(p);
  if (c < base_ || len < 0 || c + len > base_ + bytes_) return -1;
  return c - base_;
}

at::DataPtr ShmArena::allocate(size_t nbytes, int64_t phase) {
  TORCH_INTERNAL_ASSERT(owner_, "fsdp: allocating from a peer's exchange arena");
  TORCH_INTERNAL_ASSERT(phase >= 0 && phase < kPage, "fsdp: arena phase ", phase, " is not inside a page");
  const int64_t len = round_up(std::max<int64_t>(static_cast<int64_t>(nbytes) + phase, 1), kPage);
  int64_t off = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < len) continue;
      off = it->first;
      const int64_t rest = it->second - len;
      free_.erase(it);
      if (rest > 0) free_[off + len] = rest;
      break;
    }
  }
  if (off < 0) return {};
  if (::posix_fallocate(fd_, off, len) != 0) {
    release(off, len);
    return {};
  }
  auto* lease = new Lease{shared_from_this(), off, len, static_cast<int64_t>(nbytes)};
  account(lease->counted);
  return at::DataPtr(base_ + off + phase, lease, [](void* ctx) {
    std::unique_ptr<Lease> l(static_cast<Lease*>(ctx));
    account(-l->counted);
    l->arena->release(l->off, l->len);
  }, at::Device(at::kCPU));
}

void ShmArena::release(int64_t off, int64_t len) {
  // The pages go back to the system; the range stays mapped everywhere.
  ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, len);
  std::lock_guard<std::mutex> lock(mu_);
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + len == next->first) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_[off] = len;
}

}  // namespace fsdp::comm::detail

namespace fsdp::comm {

int64_t collective_buffer_bytes() { return detail::g_live.load(); }

void add_collective_buffer_observer(void (*observer)(int64_t delta)) {
  std::lock_guard<std::mutex> lock(detail::g_observers_mu);
  detail::observers().push_back(observer);
}

}  // namespace fsdp::comm
