#include "state_view.h"

#include <map>
#include <set>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "runtime.h"

namespace fsdp::core::detail {

at::Tensor LocalPiece::flat() const {
  auto d = param.detach();
  TORCH_INTERNAL_ASSERT(d.is_contiguous() && d.numel() == end - begin, "parameter '", name,
                        "' does not hold its piece [", begin, ", ", end, ")");
  return d.view({-1});
}

StateView::StateView(FullyShardedBase& model) : model_(&model), runtime_(model.runtime_.get()) {}

const comm::ProcessGroup& StateView::group() const { return model_->process_group(); }
int StateView::rank() const { return model_->process_group().rank(); }
const comm::ProcessGroup& StateView::gather_group() const { return runtime_->comm_context().gather_group(); }
torch::nn::Module& StateView::module() const { return *model_->module_ptr(); }
std::shared_ptr<Tracer> StateView::tracer() const {
  return runtime_->tracer().enabled() ? runtime_->shared_tracer() : nullptr;
}

namespace {
std::string label(const Unit& u) { return u.path().empty() ? "<root>" : u.path(); }
}  // namespace

void StateView::require_idle(const char* what) const {
  TORCH_CHECK(!runtime_->in_backward(), "fsdp: ", what, " called on rank ", rank(),
              " during backward; call it between training steps");
  for (const auto& u : runtime_->units()) {
    TORCH_CHECK(u->state() == UnitState::kIdle, "fsdp: ", what, " called on rank ", rank(), " while unit '",
                label(*u), "' is in state ", to_string(u->state()), "; call it between training steps");
    TORCH_CHECK(u->flat().state() == FlatState::kSharded, "fsdp: ", what, " called on rank ", rank(),
                " while unit '", label(*u), "' holds its full parameters (inside summon_full_params or "
                "apply_with_full_params); call it after that scope ends");
  }
}

std::vector<LocalPiece> StateView::local_pieces(const char* what) const {
  require_idle(what);
  const bool rank0 = rank() == 0;
  // HYBRID_SHARD: every replica group holds the same shards; the first writes.
  const comm::ProcessGroup& replica_group = runtime_->comm_context().replica_group();
  const bool first_replica = !replica_group.defined() || replica_group.rank() == 0;
  std::vector<LocalPiece> out;
  std::set<const c10::TensorImpl*> seen;
  for (size_t u = 0; u < num_units(); ++u) {
    const bool is_sharded = sharded(u);
    for (const auto& e : entries(u)) {
      LocalPiece p;
      p.name = e.fqn;
      p.param = e.param;
      p.shape = e.shape;
      p.numel = e.numel;
      p.unit = static_cast<int>(u);
      if (is_sharded) {
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
  for (const auto& np : module().named_parameters()) {
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

size_t StateView::num_units() const { return runtime_->units().size(); }
const std::string& StateView::unit_path(size_t u) const { return runtime_->units().at(u)->path(); }
bool StateView::is_root(size_t u) const { return runtime_->units().at(u)->is_root(); }
bool StateView::sharded(size_t u) const { return runtime_->units().at(u)->flat().sharded(); }
const std::vector<FlatParamEntry>& StateView::entries(size_t u) const {
  const Unit& unit = *runtime_->units().at(u);
  return unit.flat().entries();
}
int64_t StateView::chunk_numel(size_t u) const { return runtime_->units().at(u)->flat().chunk_numel(); }
int64_t StateView::padded_numel(size_t u) const { return runtime_->units().at(u)->flat().padded_numel(); }
at::TensorOptions StateView::flat_options(size_t u) const { return runtime_->units().at(u)->flat().options(); }
const at::Tensor& StateView::shard(size_t u) const { return runtime_->units().at(u)->flat().shard(); }

at::Tensor StateView::gather_full(size_t u, const at::Tensor& chunk) const {
  const FlatParameter& flat = runtime_->units().at(u)->flat();
  if (!flat.sharded()) return chunk;
  // Own buffers in the shards' dtype, not the unit's unsharded buffer (the
  // low-precision compute copy under mixed precision): the full-precision values.
  // On the compute device, where the group moves tensors ([Note: offload] in flat_param.h).
  auto full = torch::empty({flat.padded_numel()}, flat.options());
  comm::all_gather_into(runtime_->comm_context().gather_group(), full, chunk.to(full.device()),
                        {comm::Phase::kStateDict, runtime_->units().at(u)->label()})
      .wait();  // the shard group
  return full;
}

at::Tensor StateView::gather_full(size_t u) const { return gather_full(u, shard(u)); }

at::Tensor StateView::view_of(size_t u, const at::Tensor& full, size_t i) const {
  return runtime_->units().at(u)->flat().view_of(full, i);
}

void StateView::use_full_views(size_t u, const at::Tensor& full) { runtime_->units().at(u)->flat().use_views_of(full); }

void StateView::use_shard_views(size_t u, const at::Tensor* write_back) {
  FlatParameter& flat = runtime_->units().at(u)->flat();
  if (write_back) flat.copy_chunk_to_shard(*write_back);
  flat.use_shard_views();
}

StateDictSelection& StateView::state_dict_selection() { return model_->state_dict_selection_; }

}  // namespace fsdp::core::detail
