#pragma once
// [Note: padded flat buffer]
// A unit's parameters, in order, are laid end to end in one *flat buffer* of
// `padded_numel` elements: `total_numel` real elements then zero padding so that
// the buffer divides into `world` equal *chunks* (see collectives.h). Rank r owns
// chunk r, its *shard*. A parameter spans [offset, offset + numel) of the flat
// buffer; its *piece* on rank r is the intersection of that span with chunk r,
// possibly empty. Outside forward/backward every parameter points (set_data) at
// its piece of the shard, 1-D; while the unit is unsharded every parameter points
// at its full-shape view of the *unsharded* flat buffer.
//
// The unsharded buffer is freed and re-allocated by swapping its StorageImpl's
// data pointer, never by replacing tensors: autograd saved the views used in
// forward, and they must see the re-gathered data in backward.
//
// Under NO_SHARD the "shard" is the whole buffer (world 1, no padding), pieces
// are full-shape views of it, and nothing is ever gathered.

#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp::detail {

struct FlatParamEntry {
  std::string fqn;              // name in the unwrapped model
  std::string module_path;      // path of the module that registered it
  at::Tensor param;             // the user's registered parameter (identity never changes)
  std::vector<int64_t> shape;   // original shape
  int64_t numel = 0;
  int64_t offset = 0;           // in the flat buffer
  int64_t piece_begin = 0;      // this rank's piece, in flat coordinates
  int64_t piece_end = 0;        // (piece_begin == piece_end: empty piece)
};

enum class FlatState { Sharded, Unsharded };
const char* to_string(FlatState s);

class FlatParameter {
 public:
  /// Copies the parameters' current values into this rank's shard.
  FlatParameter(std::vector<FlatParamEntry> entries, int rank, int world, bool sharded);

  FlatState state() const { return state_; }
  bool sharded() const { return sharded_; }
  int64_t total_numel() const { return total_numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  int64_t chunk_numel() const { return chunk_numel_; }
  std::vector<FlatParamEntry>& entries() { return entries_; }
  const std::vector<FlatParamEntry>& entries() const { return entries_; }
  const at::Tensor& shard() const { return shard_; }
  at::TensorOptions options() const { return shard_.options(); }

  /// Unsharded buffer: allocation state and the tensor collectives fill.
  bool unsharded_allocated() const;
  void alloc_unsharded();
  void free_unsharded();
  const at::Tensor& unsharded() const { return unsharded_; }
  int64_t unsharded_bytes() const;

  /// Points every parameter at its full-shape view (Unsharded) or its piece (Sharded).
  void use_unsharded_views();
  void use_shard_views();

  /// Copies this rank's chunk of the unsharded buffer into the shard (write-back
  /// after parameters were changed while unsharded).
  void copy_unsharded_to_shard();

  /// Piece of entry i inside a shard-sized tensor (1-D; full shape under NO_SHARD).
  at::Tensor piece_of(const at::Tensor& shard_sized, size_t i) const;
  /// Full-shape view of entry i inside a flat-sized tensor.
  at::Tensor view_of(const at::Tensor& flat_sized, size_t i) const;

 private:
  std::vector<FlatParamEntry> entries_;
  int rank_;
  int world_;
  bool sharded_;
  int64_t total_numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t chunk_numel_ = 0;
  at::Tensor shard_;       // chunk_numel_ elements, owned
  at::Tensor unsharded_;   // padded_numel_ elements; storage swapped in/out
  FlatState state_ = FlatState::Sharded;
};

}  // namespace fsdp::detail
