// See [Note: mapped flat buffer] in include/fsdp/comm/mapped_flat.h.
#include "fsdp/comm/mapped_flat.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include "comm/transport.h"

namespace fsdp::comm {

namespace {

at::Tensor tensor_on(at::DataPtr memory, int64_t numel, at::ScalarType dtype) {
  const auto nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(memory), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
}

}  // namespace

std::unique_ptr<MappedFlat> MappedFlat::create(const ProcessGroup& g, int64_t chunk_numel, at::ScalarType dtype,
                                               const CallLabel& label, std::string* why) {
  TORCH_CHECK(g.defined() && chunk_numel > 0, "fsdp: MappedFlat::create needs a group and a positive chunk size");
  const int n = g.size();
  if (n < 2) {
    *why = "the group has one rank: there is nothing to gather";
    return nullptr;
  }
  // Phase 1 (local): this rank's chunk, in memory the peers can map (the transport's).
  const int64_t chunk_bytes = chunk_numel * static_cast<int64_t>(c10::elementSize(dtype));
  detail::MappableChunk chunk;
  if (g.transport()) chunk = g.transport()->allocate_mappable_chunk(g.desc(), chunk_bytes);
  // Phase 2 (collective): every rank's offset, or -1 where it could not.
  auto mine = at::full({1}, chunk.offset, at::kLong);
  auto all = at::empty({n}, at::kLong);
  all_gather_into(g, all, mine, label).wait();
  std::vector<int64_t> offsets(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + n);
  for (int r = 0; r < n; ++r) {
    if (offsets[static_cast<size_t>(r)] >= 0) continue;
    *why = "rank " + std::to_string(r) + " of group '" + g.name() + "' has no exchange arena to map (ranks on " +
           "several hosts, shared memory off, FSDP_SHM_DIRECT=0, or /dev/shm full)";
    return nullptr;
  }
  // Phase 3 (local): the view over every rank's chunk.
  std::unique_ptr<MappedFlat> m(new MappedFlat());
  m->group_ = g;
  m->chunk_ = tensor_on(std::move(chunk.memory), chunk_numel, dtype).zero_();
  m->view_ = g.transport()->map_flat(std::move(offsets), chunk_bytes);
  TORCH_INTERNAL_ASSERT(m->view_, "fsdp: group '", g.name(), "' gave every rank a mappable chunk but maps none");
  m->flat_ = at::from_blob(m->view_->data(), {n * chunk_numel}, at::TensorOptions().dtype(dtype));
  m->count_ = at::zeros({1}, at::kLong);
  m->counts_ = at::zeros({n}, at::kLong);
  return m;
}

MappedFlat::~MappedFlat() = default;

int64_t MappedFlat::seam_bytes() const { return view_->seam_bytes(); }

CommHandle MappedFlat::refresh(const CallLabel& label) {
  count_.fill_(++refreshes_);
  auto rendezvous = std::make_shared<CommHandle>(all_gather_into(group_, counts_, count_, label));
  const CommPath path = rendezvous->path();
  return CommHandle({}, group_, "all_gather", [this, rendezvous]() {
    rendezvous->wait();
    check_counts();
    view_->copy_seams();
  }, path);
}

void MappedFlat::check_counts() const {
  const int64_t* c = counts_.data_ptr<int64_t>();
  for (int r = 0; r < group_.size(); ++r) {
    TORCH_CHECK(c[r] == refreshes_, "fsdp: rank ", group_.rank(), " of group '", group_.name(), "' has gathered this "
                "mapped flat buffer ", refreshes_, " times, rank ", r, " ", c[r], " times: the ranks ran different "
                "forward or backward passes (a data-dependent branch, or a rank that skipped a step)");
  }
}

}  // namespace fsdp::comm
