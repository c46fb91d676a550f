// See shm_segment.h and [Note: shared-memory transport] in shm_channel.cpp.
#include "shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <random>
#include <sstream>

#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

namespace {

constexpr uint64_t kSegmentMagic = 0x3174687370647366ull;  // "fsdpsht1"

int64_t data_offset(int nslots) {
  return round_up(int64_t(sizeof(SegHeader)) + nslots * int64_t(sizeof(SlotHeader)), 4096);
}

// A fresh name for this process's segment: "/fsdp.<pid>.<random hex>".
std::string fresh_segment_name() {
  std::random_device rd;
  std::ostringstream os;
  os << "/fsdp." << ::getpid() << "." << std::hex << ((uint64_t(rd()) << 32) ^ rd());
  return os.str();
}

// The header and slot headers of a segment just created at `base`; the magic last, so a
// peer that sees it sees the rest.
void init_segment(ShmSegment& seg, uint64_t nonce) {
  auto* h = new (seg.base) SegHeader();
  h->nonce = nonce;
  h->slot_bytes = seg.slot_bytes;
  h->nslots = seg.nslots;
  h->pid = ::getpid();
  for (int i = 0; i < seg.nslots; ++i) new (seg.slot(i)) SlotHeader();
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kSegmentMagic;
}

}  // namespace

int64_t ShmSegment::mapping_bytes(int nslots, int64_t slot_bytes) { return data_offset(nslots) + nslots * slot_bytes; }

ShmSegment::ShmSegment(void* base, int nslots, int64_t slot_bytes)
    : base(base), bytes(mapping_bytes(nslots, slot_bytes)), nslots(nslots), slot_bytes(slot_bytes) {}

ShmSegment::~ShmSegment() {
  if (base) ::munmap(base, static_cast<size_t>(bytes));
}

char* ShmSegment::data(int i) const { return static_cast<char*>(base) + data_offset(nslots) + i * slot_bytes; }

std::unique_ptr<ShmSegment> create_segment(int nslots, int64_t slot_bytes, uint64_t nonce, std::string* name,
                                           std::string* why) {
  *name = fresh_segment_name();
  const int64_t bytes = ShmSegment::mapping_bytes(nslots, slot_bytes);
  const int fd = ::shm_open(name->c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why = std::string("shm_open: ") + std::strerror(errno);
    return nullptr;
  }
  int err = ::ftruncate(fd, bytes) == 0 ? 0 : errno;
  if (err == 0) err = ::posix_fallocate(fd, 0, bytes);
  void* base = err == 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (err == 0 && base == MAP_FAILED) err = errno;
  ::close(fd);
  if (err != 0) {
    ::shm_unlink(name->c_str());
    *why = "cannot reserve " + std::to_string(bytes) + " bytes in /dev/shm: " + std::strerror(err);
    return nullptr;
  }
  auto seg = std::make_unique<ShmSegment>(base, nslots, slot_bytes);
  init_segment(*seg, nonce);
  return seg;
}

std::unique_ptr<ShmSegment> open_segment(const std::string& name, uint64_t nonce, int nslots, int64_t slot_bytes,
                                         std::string* why) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    *why = "cannot open " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  const int64_t bytes = ShmSegment::mapping_bytes(nslots, slot_bytes);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size != bytes) {
    ::close(fd);
    *why = name + " has " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(bytes) +
           " (ranks disagree on FSDP_SHM_SLOT_KIB?)";
    return nullptr;
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    *why = "cannot map " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  auto seg = std::make_unique<ShmSegment>(base, nslots, slot_bytes);
  const auto* h = seg->hdr();
  if (h->magic != kSegmentMagic || h->nonce != nonce || h->nslots != nslots || h->slot_bytes != slot_bytes) {
    *why = name + " is not the peer's segment (another IPC namespace?)";
    return nullptr;
  }
  return seg;
}

void ring_doorbell(SegHeader* h) {
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) != 0) {
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->doorbell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

void sleep_on_doorbell(SegHeader* h, uint32_t bell, std::chrono::microseconds t) {
  timespec ts{static_cast<time_t>(t.count() / 1000000), static_cast<long>(t.count() % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->doorbell), FUTEX_WAIT, bell, &ts, nullptr, 0);
}

}  // namespace fsdp::comm::detail
