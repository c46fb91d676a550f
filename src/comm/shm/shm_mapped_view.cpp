// See shm_mapped_view.h and [Note: mapped flat buffer] in include/fsdp/comm/mapped_flat.h.
#include "shm_mapped_view.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

#include "comm/tensor_bytes.h"
#include "shm_arena.h"

namespace fsdp::comm::detail {

ShmMappedView::ShmMappedView(std::vector<std::shared_ptr<ShmArena>> arenas, std::vector<int64_t> offsets,
                             int64_t chunk_bytes)
    : arenas_(std::move(arenas)) {
  TORCH_CHECK(::sysconf(_SC_PAGESIZE) == kArenaPage, "fsdp: a mapped flat buffer needs 4 KiB pages; this system's "
              "are ", ::sysconf(_SC_PAGESIZE), " bytes");
  const auto n = static_cast<int64_t>(arenas_.size());
  TORCH_INTERNAL_ASSERT(n >= 1 && static_cast<int64_t>(offsets.size()) == n && chunk_bytes > 0);
  const int64_t total = n * chunk_bytes;
  reserved_ = round_up(total, kArenaPage);
  // Phase 1: the whole range, private and writable; the chunks' whole pages replace it.
  void* p = ::mmap(nullptr, static_cast<size_t>(reserved_), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "fsdp: cannot reserve ", reserved_, " bytes for a mapped flat buffer: ",
              std::strerror(errno));
  base_ = static_cast<char*>(p);
  std::vector<bool> shared(static_cast<size_t>(reserved_ / kArenaPage), false);
  // Phase 2: each chunk's whole pages are the owner's arena pages.
  for (int64_t r = 0; r < n; ++r) {
    const int64_t lo = r * chunk_bytes, hi = lo + chunk_bytes;
    TORCH_INTERNAL_ASSERT(offsets[r] >= 0 && offsets[r] % kArenaPage == lo % kArenaPage,
                          "fsdp: chunk ", r, " lies at arena offset ", offsets[r], ", off its page phase");
    const int64_t p0 = round_up(lo, kArenaPage) / kArenaPage, p1 = hi / kArenaPage;
    if (p1 <= p0) continue;
    const int64_t file_off = offsets[r] - lo + p0 * kArenaPage;
    void* at = ::mmap(base_ + p0 * kArenaPage, static_cast<size_t>((p1 - p0) * kArenaPage), PROT_READ,
                      MAP_SHARED | MAP_FIXED | MAP_POPULATE, arenas_[r]->fd(), file_off);
    TORCH_CHECK(at != MAP_FAILED, "fsdp: cannot map rank ", r, "'s chunk into a mapped flat buffer: ",
                std::strerror(errno));
    for (int64_t q = p0; q < p1; ++q) shared[static_cast<size_t>(q)] = true;
  }
  // Phase 3: the rest are seams, filled from every rank's bytes on them.
  for (int64_t q = 0; q < static_cast<int64_t>(shared.size()); ++q) {
    if (shared[static_cast<size_t>(q)]) continue;
    ++seam_pages_;
    const int64_t plo = q * kArenaPage, phi = std::min(plo + kArenaPage, total);
    for (int64_t r = plo / chunk_bytes; r < n && r * chunk_bytes < phi; ++r) {
      const int64_t a = std::max(plo, r * chunk_bytes), b = std::min(phi, (r + 1) * chunk_bytes);
      if (b > a) seams_.push_back({a, arenas_[r]->base() + offsets[r] + (a - r * chunk_bytes), b - a});
    }
  }
}

ShmMappedView::~ShmMappedView() {
  if (base_) ::munmap(base_, static_cast<size_t>(reserved_));
}

int64_t ShmMappedView::seam_bytes() const { return seam_pages_ * kArenaPage; }

void ShmMappedView::copy_seams() const {
  for (const Seam& s : seams_) std::memcpy(base_ + s.at, s.from, static_cast<size_t>(s.len));
}

}  // namespace fsdp::comm::detail
