#include "local_pieces.h"

#include <map>
#include <set>

#include "../fsdp/runtime.h"

namespace fsdp::state {

at::Tensor LocalPiece::flat() const {
  auto d = param.detach();
  TORCH_INTERNAL_ASSERT(d.is_contiguous() && d.numel() == end - begin, "parameter '", name,
                        "' does not hold its piece [", begin, ", ", end, ")");
  return d.view({-1});
}

std::vector<LocalPiece> local_pieces(FullyShardedBase& model, const char* what) {
  auto& rt = model.runtime();
  const bool rank0 = model.process_group().rank() == 0;
  // HYBRID_SHARD: every replica group holds the same shards; the first writes.
  const bool first_replica = !rt.replica_group().defined() || rt.replica_group().rank() == 0;
  std::vector<LocalPiece> out;
  std::set<const c10::TensorImpl*> seen;
  for (auto& u : rt.units()) {
    TORCH_CHECK(u->state() == detail::UnitState::IDLE && u->flat().state() == detail::FlatState::Sharded,
                "fsdp: ", what, " called on rank ", model.process_group().rank(), " while unit '", u->path(),
                "' is in state ", detail::to_string(u->state()), "; call it between training steps");
    const bool sharded = u->flat().sharded();
    for (const auto& e : u->flat().entries()) {
      LocalPiece p;
      p.name = e.fqn;
      p.param = e.param;
      p.shape = e.shape;
      p.numel = e.numel;
      p.unit = u->index();
      if (sharded) {
        p.begin = e.piece_begin - e.offset;
        p.end = e.piece_end - e.offset;
        if (p.end <= p.begin) p.begin = p.end = 0;
        p.writer = first_replica;
      } else {
        p.begin = 0;
        p.end = e.numel;
        p.replicated = true;
        p.writer = rank0;
      }
      seen.insert(e.param.unsafeGetTensorImpl());
      out.push_back(std::move(p));
    }
  }
  std::map<const c10::TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < out.size(); ++i) index_of[out[i].param.unsafeGetTensorImpl()] = i;
  for (const auto& np : model.module_ptr()->named_parameters()) {
    auto it = index_of.find(np.value().unsafeGetTensorImpl());
    if (it != index_of.end()) {
      // A tied parameter: the flat parameter holds it once, under its first name.
      if (np.key() != out[it->second].name) out[it->second].aliases.push_back(np.key());
      continue;
    }
    if (!seen.insert(np.value().unsafeGetTensorImpl()).second) continue;
    LocalPiece p;
    p.name = np.key();
    p.param = np.value();
    p.shape = np.value().sizes().vec();
    p.numel = np.value().numel();
    p.begin = 0;
    p.end = p.numel;
    p.replicated = true;
    p.writer = rank0;
    index_of[p.param.unsafeGetTensorImpl()] = out.size();
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace fsdp::state
