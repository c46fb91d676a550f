#include "flat_param.h"

#include <c10/core/StorageImpl.h>

#include "fsdp/comm/collectives.h"
#include "memory/host_options.h"

namespace fsdp::core::detail {

const char* to_string(FlatState s) { return s == FlatState::kSharded ? "SHARDED" : "UNSHARDED"; }

FlatParameter::FlatParameter(std::vector<FlatParamEntry> entries, int rank, int world, bool sharded,
                             FlatPrecision precision, bool offload)
    : entries_(std::move(entries)), rank_(sharded ? rank : 0), world_(sharded ? world : 1),
      sharded_(sharded), precision_(precision), offloaded_(offload),
      compute_device_(entries_.empty() ? c10::Device(c10::kCPU) : entries_.front().param.device()) {
  TORCH_INTERNAL_ASSERT(!entries_.empty());
  const auto compute_opts = entries_.front().param.options().requires_grad(false);
  const auto opts = offloaded_ ? memory::host_options(compute_opts) : compute_opts;
  for (auto& e : entries_) {
    e.offset = total_numel_;
    total_numel_ += e.numel;
  }
  padded_numel_ = comm::padded_numel(total_numel_, world_);
  chunk_numel_ = padded_numel_ / world_;
  const int64_t lo = rank_ * chunk_numel_, hi = lo + chunk_numel_;
  shard_ = at::empty({chunk_numel_}, opts).zero_();
  for (auto& e : entries_) {
    e.piece_begin = std::max(e.offset, lo);
    e.piece_end = std::min(e.offset + e.numel, hi);
    if (e.piece_end <= e.piece_begin) e.piece_begin = e.piece_end = std::max(lo, std::min(e.offset, hi));
    if (e.piece_end > e.piece_begin) {
      at::NoGradGuard no_grad;
      auto src = e.param.detach().reshape({-1}).slice(0, e.piece_begin - e.offset, e.piece_end - e.offset);
      shard_.slice(0, e.piece_begin - lo, e.piece_end - lo).copy_(src);
    }
  }
  const auto compute = precision_.param_dtype.value_or(shard_.scalar_type());
  if (sharded_ || offloaded_ || compute != shard_.scalar_type()) {
    // Created without memory (allocating and freeing it here would put a whole
    // unit's worth of bytes on the construction peak); alloc_unsharded gives it
    // storage when a gather needs it.
    unsharded_ = at::empty({0}, compute_opts.dtype(compute));
    unsharded_.unsafeGetTensorImpl()->set_sizes_contiguous({padded_numel_});
    free_unsharded();
  } else {
    unsharded_ = shard_;  // NO_SHARD: the shard is the whole buffer
  }
  use_shard_views();
}

bool FlatParameter::unsharded_allocated() const {
  if (mapped_) return mapped_fresh_;
  return unsharded_.storage().nbytes() > 0 || padded_numel_ == 0;
}

int64_t FlatParameter::unsharded_bytes() const {
  if (mapped_) return 0;  // the seam pages only, which stay for good
  return separate_unsharded() && unsharded_allocated() ? padded_numel_ * unsharded_.element_size() : 0;
}

at::Tensor FlatParameter::shard_for_gather() const {
  if (offloaded_)  // always a copy: the shard stays the host's, the gather reads the device's
    return shard_.to(options().dtype(compute_dtype()), /*non_blocking=*/true, /*copy=*/true);
  return low_precision() ? shard_.to(compute_dtype()) : shard_;
}

at::Tensor FlatParameter::to_shard_side(const at::Tensor& shard_sized, at::ScalarType dtype) const {
  if (!offloaded_) return shard_sized.scalar_type() == dtype ? shard_sized : shard_sized.to(dtype);
  // Always a copy, as on a GPU. Pinned, so that a GPU's copy to it is a DMA; blocking, because
  // the source may view a reduction's output buffer, which returns to its pool (and the next
  // reduction) once the shard is delivered. The host thread then steps it ([Note: host steps]).
  at::Tensor host = at::empty(shard_sized.sizes(), memory::host_options(shard_sized.options().dtype(dtype)));
  host.copy_(shard_sized);
  return host;
}

void FlatParameter::place_on_compute_device() {
  TORCH_INTERNAL_ASSERT(offloaded_ && state_ == FlatState::kSharded && (padded_numel_ == 0 || !unsharded_allocated()));
  at::Tensor placed = at::empty_like(shard_, options().pinned_memory(false));
  placed.copy_(shard_);
  shard_ = std::move(placed);
  offloaded_ = false;
  if (!separate_unsharded()) unsharded_ = shard_;  // NO_SHARD in full precision computes in the shard
  use_shard_views();
}

void FlatParameter::alloc_unsharded(memory::BufferPool& pool) {
  TORCH_INTERNAL_ASSERT(separate_unsharded());
  if (mapped_) {
    mapped_fresh_ = true;
    return;
  }
  if (unsharded_allocated()) return;
  const size_t nbytes = padded_numel_ * unsharded_.element_size();
  auto* impl = unsharded_.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(pool.allocate(nbytes, unsharded_.device()));
  impl->set_nbytes(nbytes);
}

void FlatParameter::free_unsharded() {
  TORCH_INTERNAL_ASSERT(separate_unsharded());
  if (mapped_) {
    mapped_fresh_ = false;
    return;
  }
  auto* impl = unsharded_.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, unsharded_.device()));
  impl->set_nbytes(0);
}

void FlatParameter::map_unsharded(std::unique_ptr<comm::MappedFlat> mapped) {
  TORCH_INTERNAL_ASSERT(mapped && sharded_ && !low_precision() && !offloaded_ && !mapped_);
  TORCH_INTERNAL_ASSERT(state_ == FlatState::kSharded && (padded_numel_ == 0 || !unsharded_allocated()));
  TORCH_INTERNAL_ASSERT(mapped->chunk().numel() == chunk_numel_ && mapped->flat().numel() == padded_numel_ &&
                        mapped->chunk().scalar_type() == shard_.scalar_type());
  {
    at::NoGradGuard no_grad;
    mapped->chunk().copy_(shard_);
  }
  shard_ = mapped->chunk();
  auto* impl = unsharded_.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(mapped->flat().data_ptr(), compute_device_));
  impl->set_nbytes(static_cast<size_t>(padded_numel_) * unsharded_.element_size());
  mapped_ = std::move(mapped);
  mapped_fresh_ = false;
  use_shard_views();
}

at::Tensor FlatParameter::piece_of(const at::Tensor& shard_sized, size_t i) const {
  const auto& e = entries_[i];
  if (!sharded_) return shard_sized.slice(0, e.offset, e.offset + e.numel).view(e.shape);
  const int64_t lo = rank_ * chunk_numel_;
  return shard_sized.slice(0, e.piece_begin - lo, e.piece_end - lo);
}

at::Tensor FlatParameter::view_of(const at::Tensor& flat_sized, size_t i) const {
  const auto& e = entries_[i];
  return flat_sized.slice(0, e.offset, e.offset + e.numel).view(e.shape);
}

void FlatParameter::copy_unsharded_to_shard() {
  if (!sharded_) return;
  TORCH_INTERNAL_ASSERT(unsharded_allocated());
  copy_chunk_to_shard(unsharded_);
}

void FlatParameter::copy_chunk_to_shard(const at::Tensor& flat_sized) {
  if (flat_sized.is_same(shard_)) return;
  at::NoGradGuard no_grad;
  shard_.copy_(flat_sized.slice(0, rank_ * chunk_numel_, (rank_ + 1) * chunk_numel_));
}

void FlatParameter::use_views_of(const at::Tensor& flat_sized) {
  for (size_t i = 0; i < entries_.size(); ++i) entries_[i].param.set_data(view_of(flat_sized, i));
  state_ = FlatState::kUnsharded;
}

void FlatParameter::use_unsharded_views() {
  TORCH_INTERNAL_ASSERT(unsharded_allocated(), "use_unsharded_views on a freed buffer");
  for (size_t i = 0; i < entries_.size(); ++i) entries_[i].param.set_data(view_of(unsharded_, i));
  state_ = FlatState::kUnsharded;
}

void FlatParameter::use_shard_views() {
  for (size_t i = 0; i < entries_.size(); ++i) entries_[i].param.set_data(piece_of(shard_, i));
  state_ = FlatState::kSharded;
}

}  // namespace fsdp::core::detail
