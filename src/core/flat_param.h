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
//
// [Note: mixed precision]
// With a param_dtype (FlatPrecision), the shard stays in the parameters' own
// dtype (fp32 master weights: what the optimizer sees) and the unsharded buffer
// has param_dtype: each rank casts its shard before the all-gather, so only
// param_dtype bytes move, and forward/backward compute with the gathered
// low-precision views. Under NO_SHARD the unsharded buffer is then a separate
// low-precision copy of the shard (separate_unsharded()).
//
// Choice: the parameter leaf itself changes dtype (fp32 piece <-> bf16 full
// view). libtorch 1.13's set_data drops the leaf's AccumulateGrad node when the
// dtype changes (VariableHooks::set_data, type_equal check), so Unit re-acquires
// the node each iteration while the parameter is in its low-precision full
// shape (its input metadata then records bf16 + full shape) and moves its post
// hook to it; the old node, and its hook, die with it. The alternative, a
// separate low-precision leaf per parameter swapped into the module, would
// break the user's own references to the parameter during forward. Gradients
// arrive in param_dtype, are flattened into a reduce_dtype flat buffer,
// reduced, and cast to the shard's dtype for the optimizer (unless
// keep_low_precision_grads).

// [Note: offload]
// With Options::cpu_offload the shard (full-precision master weights) lives in
// host memory, pinned when the model is on a GPU, and the parameters' pieces, their
// gradient pieces and hence the optimizer state are host tensors. The model's device
// is the *compute device*: the unsharded buffer, flat gradients and reductions live
// there, as without offload. Two copies join the sides: shard_for_gather copies the
// shard to the compute device (in compute_dtype: only those bytes cross) before every
// all-gather, and Unit::adopt_reduced_shard copies the reduced gradient shard to the
// host. Even NO_SHARD in full precision then has a separate unsharded buffer (a device
// copy of the host shard). options() describes the compute side (flat-sized work),
// shard().options() the host side. When host and device are one memory (a model on
// the CPU) the copies are plain memory copies and every value equals the run without
// offload bit for bit.

// [Note: zero-copy gathers]
// With Options::zero_copy_gather, on a shard group that shares memory, the shard lives
// in this rank's exchange arena and the unsharded buffer is a mapped flat buffer
// ([Note: mapped flat buffer] in include/fsdp/comm/mapped_flat.h): its chunks are the
// ranks' shards themselves, mapped. "Allocating" it reserves nothing, "freeing" it only
// marks it stale, and the gather is MappedFlat::refresh: a rendezvous and a copy of the
// seam pages. The mapping stays for the unit's life; its memory is the seam pages.
//
// The rule it needs, that no rank writes its shard while a peer reads it and no peer
// reads it before a refresh called after the write, holds in training by construction:
// a rank writes its shard in the optimizer step, which follows the unit's reduction;
// the reduction completes only once every peer has delivered its gradient, i.e. has
// finished its backward through the unit, the last read; and each peer's next read
// follows its next gather, whose rendezvous waits for the writer's next gather, which
// the writer issues after its step. Evaluation has no reduction to close its reads:
// the root's evaluation forward ends with a barrier instead (Runtime::post_forward).
// Not covered: a training forward whose backward never runs, followed on one rank by a
// write outside any collective (load_state_dict) while a peer still computes that
// forward's last unit; write after a collective (a barrier) there.
// Same dtype only (a cast shard is a copy anyway), no offload, the CPU.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp/comm/mapped_flat.h"

#include "memory/buffer_pool.h"
#include "precision/flat_precision.h"

namespace fsdp::core::detail {

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

using precision::FlatPrecision;

enum class FlatState { kSharded, kUnsharded };
const char* to_string(FlatState s);

class FlatParameter {
 public:
  /// Copies the parameters' current values into this rank's shard.
  FlatParameter(std::vector<FlatParamEntry> entries, int rank, int world, bool sharded,
                FlatPrecision precision = {}, bool offload = false);

  FlatState state() const { return state_; }
  bool sharded() const { return sharded_; }
  int64_t total_numel() const { return total_numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  int64_t chunk_numel() const { return chunk_numel_; }
  std::vector<FlatParamEntry>& entries() { return entries_; }
  const std::vector<FlatParamEntry>& entries() const { return entries_; }
  const at::Tensor& shard() const { return shard_; }
  /// The compute side: the shard's dtype on the model's device ([Note: offload]).
  at::TensorOptions options() const { return shard_.options().device(compute_device_); }
  /// The shard is in host memory away from the compute device ([Note: offload]).
  bool offloaded() const { return offloaded_; }
  /// Moves an offloaded shard to the compute device for good ([Note: auto placement] in
  /// src/engine/placement.h): the parameters then view it there. Sharded state, unsharded
  /// buffer freed.
  void place_on_compute_device();
  /// Dtypes: see [Note: mixed precision].
  const FlatPrecision& precision() const { return precision_; }
  at::ScalarType compute_dtype() const { return unsharded_.scalar_type(); }
  at::ScalarType reduce_dtype() const { return precision_.reduce_dtype.value_or(shard_.scalar_type()); }
  at::ScalarType grad_dtype() const {
    return precision_.keep_low_precision_grads ? compute_dtype() : shard_.scalar_type();
  }
  bool low_precision() const { return compute_dtype() != shard_.scalar_type(); }
  /// The unsharded buffer is not the shard itself (sharded, a low-precision copy, or
  /// a device copy of an offloaded shard).
  bool separate_unsharded() const { return sharded_ || low_precision() || offloaded_; }
  /// The shard as the all-gather sends it (cast to compute_dtype(), on the compute device).
  at::Tensor shard_for_gather() const;
  /// A shard-sized tensor of this unit (a reduced gradient) in `dtype` where the shard
  /// lives: itself or a cast without offload, a host copy with it.
  at::Tensor to_shard_side(const at::Tensor& shard_sized, at::ScalarType dtype) const;

  /// Moves the shard into `mapped`'s chunk and makes its flat buffer the unsharded
  /// buffer for good ([Note: zero-copy gathers]). Sharded state, same dtype, no offload.
  void map_unsharded(std::unique_ptr<comm::MappedFlat> mapped);
  bool mapped() const { return mapped_ != nullptr; }
  comm::MappedFlat& mapped_flat() const { return *mapped_; }

  /// Unsharded buffer: allocation state and the tensor collectives fill. Mapped: whether
  /// it was gathered (or a gather is pending) since it was last freed.
  bool unsharded_allocated() const;
  void alloc_unsharded(memory::BufferPool& pool);  // memory from the pool ([Note: buffer pool])
  void free_unsharded();
  const at::Tensor& unsharded() const { return unsharded_; }
  int64_t unsharded_bytes() const;

  /// Points every parameter at its full-shape view (Unsharded) or its piece (Sharded).
  void use_unsharded_views();
  void use_shard_views();
  /// Points every parameter at its full-shape view of a flat-sized tensor of any
  /// dtype (full-precision gathers), and copies this rank's chunk of it back.
  void use_views_of(const at::Tensor& flat_sized);
  void copy_chunk_to_shard(const at::Tensor& flat_sized);

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
  FlatPrecision precision_;
  bool offloaded_;
  c10::Device compute_device_;
  int64_t total_numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t chunk_numel_ = 0;
  at::Tensor shard_;       // chunk_numel_ elements, owned
  at::Tensor unsharded_;   // padded_numel_ elements; storage swapped in/out
  std::unique_ptr<comm::MappedFlat> mapped_;  // [Note: zero-copy gathers]; null: copying gathers
  bool mapped_fresh_ = false;
  FlatState state_ = FlatState::kSharded;
};

}  // namespace fsdp::core::detail
