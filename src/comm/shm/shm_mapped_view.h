#pragma once
// Internal to src/comm: the address range of a mapped flat buffer, whose chunks are the
// ranks' own arena memory ([Note: mapped flat buffer] in include/fsdp/comm/mapped_flat.h).
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/transport.h"

namespace fsdp::comm::detail {

class ShmArena;

/// The shared-memory transport's FlatMapping (Transport::map_flat).
class ShmMappedView final : public FlatMapping {
 public:
  /// `arenas[r]`: rank r's exchange arena (this rank's own included); `offsets[r]`: where
  /// rank r's chunk of `chunk_bytes` lies in it, at the page offset its place in the flat
  /// buffer has (offsets[r] % page == r * chunk_bytes % page). Throws c10::Error when the
  /// system refuses a mapping.
  ShmMappedView(std::vector<std::shared_ptr<ShmArena>> arenas, std::vector<int64_t> offsets, int64_t chunk_bytes);
  ~ShmMappedView() override;
  ShmMappedView(const ShmMappedView&) = delete;
  ShmMappedView& operator=(const ShmMappedView&) = delete;

  /// size * chunk_bytes bytes: every page wholly inside one chunk maps that rank's arena
  /// read-only; the pages where chunks meet are private (seams).
  char* data() const override { return base_; }
  /// Copies every rank's current bytes of the seam pages from its arena.
  void copy_seams() const override;
  /// Bytes of the private seam pages (what the view holds beyond the chunks themselves).
  int64_t seam_bytes() const override;

 private:
  struct Seam {  // a rank's bytes on a seam page
    int64_t at;   // offset in the view
    const char* from;
    int64_t len;
  };
  std::vector<std::shared_ptr<ShmArena>> arenas_;  // keep the peers' mappings (and files) alive
  char* base_ = nullptr;
  int64_t reserved_ = 0;
  int64_t seam_pages_ = 0;
  std::vector<Seam> seams_;
};

}  // namespace fsdp::comm::detail
