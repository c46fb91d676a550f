#pragma once
/// A flat buffer whose chunks are the ranks' own memory, so that an all-gather moves
/// almost nothing.
///
/// [Note: mapped flat buffer]
/// On a group whose ranks run on one host and share memory (the shared-memory transport,
/// with its exchange arenas; src/comm/shm/shm_arena.cpp), rank r keeps its chunk in its
/// exchange arena, and every rank's flat buffer is one address range in which each page
/// lying wholly inside chunk r maps rank r's arena page, read-only. The pages where two
/// chunks meet belong to no single file page, so they are private copies (seams): at
/// most one per chunk boundary, plus the last. An all-gather then becomes refresh(): a
/// rendezvous (every rank has called it) followed by copying the seam bytes, instead of
/// copying the whole buffer. The page offset of each chunk in its arena equals its page
/// offset in the flat buffer, which is what lets whole pages line up.
///
/// The price is that a write to a chunk shows in every rank's flat buffer at once,
/// without a collective. The caller's protocol must keep writes and reads apart: a rank
/// writes its chunk only after every peer is done reading it, and a peer reads it only
/// after a refresh() that the writer called after writing. FSDP's units keep this by
/// construction ([Note: zero-copy gathers] in src/core/flat_param.h).
///
/// A flat buffer of the copying kind costs its whole size while gathered; this one costs
/// the seam pages, for good, and its chunk lives in the arena as long as the object.

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "fsdp/comm/call_label.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"

namespace fsdp::comm {

namespace detail {
class FlatMapping;
}

class MappedFlat {
 public:
  /// Collective over `g`: a flat buffer of `g.size()` chunks of `chunk_numel` elements of
  /// `dtype`, zero-filled. nullptr on every rank (and `why` set) when any rank cannot map
  /// one: a group of one rank, a group that is not on shared memory (ranks on several
  /// hosts, InitOptions::shared_memory off, FSDP_SHM_DIRECT=0), /dev/shm full.
  static std::unique_ptr<MappedFlat> create(const ProcessGroup& g, int64_t chunk_numel, at::ScalarType dtype,
                                            const CallLabel& label, std::string* why);
  ~MappedFlat();
  MappedFlat(const MappedFlat&) = delete;
  MappedFlat& operator=(const MappedFlat&) = delete;

  /// This rank's chunk: writable, in its exchange arena, alive as long as this object
  /// or the tensor.
  const at::Tensor& chunk() const { return chunk_; }
  /// The whole buffer (size * chunk_numel elements). Read-only memory but for the seams:
  /// a write faults. Valid as long as this object.
  const at::Tensor& flat() const { return flat_; }
  /// The all-gather: once waited, flat() shows every rank's chunk as it was when that rank
  /// called refresh(). Every rank must call it the same number of times; the wait checks
  /// that they did (their counts travel with the rendezvous) and names the rank that did
  /// not.
  CommHandle refresh(const CallLabel& label);
  /// Bytes this object holds beyond the chunk: the private seam pages.
  int64_t seam_bytes() const;

 private:
  MappedFlat() = default;
  void check_counts() const;

  ProcessGroup group_;
  at::Tensor chunk_, flat_;
  std::unique_ptr<detail::FlatMapping> view_;
  at::Tensor count_, counts_;  // int64 [1] and [size]: this rank's refreshes, everyone's
  int64_t refreshes_ = 0;
};

}  // namespace fsdp::comm
