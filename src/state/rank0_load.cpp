// [Note: rank-0 pretrained load] in include/fsdp/state/rank0_load.h.
#include "fsdp/state/rank0_load.h"

#include "fsdp/comm/call_label.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include <torch/torch.h>

#include "comm/object_collectives.h"
#include "core/state_view.h"
#include "fsdp/comm/collectives.h"
#include "mapped_state_dict.h"

namespace fsdp {

namespace {

// The dict's tensor for a parameter: under its name or, for a tied parameter,
// under any of its aliases.
const at::Tensor* find_param(const StateDict& dict, const core::detail::LocalPiece& p) {
  if (const at::Tensor* t = dict.find(p.name)) return t;
  for (const auto& a : p.aliases)
    if (const at::Tensor* t = dict.find(a)) return t;
  return nullptr;
}

std::string check_tensor(const std::string& key, const at::Tensor* t, c10::IntArrayRef shape,
                         at::ScalarType dtype) {
  std::ostringstream os;
  if (t == nullptr) {
    os << "missing key '" << key << "' (a full state dict holds every parameter and buffer of the unwrapped model)";
  } else if (t->sizes() != shape) {
    os << "'" << key << "' has shape " << t->sizes() << ", the model expects " << shape;
  } else if (t->scalar_type() != dtype) {
    os << "'" << key << "' is " << t->scalar_type() << ", the model expects " << dtype
       << " (convert the dict, e.g. {k: v.float() for k, v in sd.items()})";
  }
  return os.str();
}

// Rank 0 only: everything load_state_dict would refuse, as one message ("" if the dict fits).
std::string check_dict(const StateDict& dict, const std::vector<core::detail::LocalPiece>& pieces, torch::nn::Module& m) {
  std::set<std::string> known;
  for (const auto& p : pieces) {
    const at::Tensor* src = find_param(dict, p);
    std::string err = check_tensor(p.name, src, p.shape, p.param.scalar_type());
    if (!err.empty()) return err;
    for (const auto& a : p.aliases) {
      const at::Tensor* other = dict.find(a);
      if (other == nullptr || other == src) continue;
      err = check_tensor(a, other, p.shape, p.param.scalar_type());
      if (!err.empty()) return err;
      if (!torch::equal(*other, *src))
        return "'" + a + "' and '" + p.name + "' are one tied parameter in the model but hold different values in "
               "the dict; drop one of them or make them equal";
    }
  }
  for (const auto& np : m.named_parameters()) known.insert(np.key());
  for (const auto& b : m.named_buffers()) {
    const std::string err = check_tensor(b.key(), dict.find(b.key()), b.value().sizes(), b.value().scalar_type());
    if (!err.empty()) return err;
    known.insert(b.key());
  }
  for (const auto& kv : dict)
    if (!known.count(kv.key()))
      return "unexpected key '" + kv.key() + "' (not a parameter or buffer of the unwrapped model)";
  return "";
}

// Rank 0: copies the dict's tensors into the full-shape views of one unit's
// flat buffer, then hands mapped sources' pages back.
void fill_unit(core::detail::StateView& view, size_t u, const at::Tensor& flat, const StateDict& dict,
               const std::map<const c10::TensorImpl*, const core::detail::LocalPiece*>& piece_of) {
  const auto& entries = view.entries(u);
  std::vector<at::Tensor> sources;
  for (size_t i = 0; i < entries.size(); ++i) {
    const at::Tensor& src = *find_param(dict, *piece_of.at(entries[i].param.unsafeGetTensorImpl()));
    const at::Tensor dst = view.view_of(u, flat, i);
    dst.copy_(src.reshape(dst.sizes()));
    sources.push_back(src);
  }
  state::detail::release_mapped_pages(sources);
}

}  // namespace

void load_state_dict_from_rank0(FullyShardedBase& model, const StateDict& rank0_dict) {
  comm::LabelScope label_scope({comm::Phase::kStateDict, "load_state_dict_from_rank0"});
  core::detail::StateView view(model);
  const comm::ProcessGroup& pg = view.group();
  const bool root = pg.rank() == 0;
  // Every rank checks that the model is idle (same answer everywhere) before the
  // first collective.
  const std::vector<core::detail::LocalPiece> pieces = view.local_pieces("load_state_dict_from_rank0");
  const std::string error =
      comm::broadcast_object(pg, root ? check_dict(rank0_dict, pieces, view.module()) : std::string(), 0);
  TORCH_CHECK(error.empty(), "fsdp: load_state_dict_from_rank0 (rank ", pg.rank(), "): rank 0's dict does not match "
              "the model: ", error, ". Nothing was loaded on any rank");

  torch::NoGradGuard no_grad;
  std::map<const c10::TensorImpl*, const core::detail::LocalPiece*> piece_of;
  for (const auto& p : pieces) piece_of[p.param.unsafeGetTensorImpl()] = &p;
  // One buffer for every sharded unit's full flat values, sized for the largest:
  // the most any rank holds beyond its shards. (Not one per unit: the transport
  // may drop its reference to a broadcast tensor only after wait() returns, so
  // two units' buffers could be alive at once.)
  // An unsharded unit's shard is broadcast in place unless it is offloaded to the host
  // ([Note: offload] in flat_param.h): the group moves tensors on the compute device.
  auto in_place = [&](size_t u) {
    return !view.sharded(u) && view.shard(u).device() == view.flat_options(u).device();
  };
  int64_t largest = 0;
  for (size_t u = 0; u < view.num_units(); ++u)
    if (!in_place(u)) largest = std::max(largest, view.padded_numel(u));
  at::Tensor buffer;
  for (size_t u = 0; u < view.num_units(); ++u) {
    if (in_place(u)) {
      // The shard is the whole flat buffer: filled on rank 0, broadcast in place.
      if (root) fill_unit(view, u, view.shard(u), rank0_dict, piece_of);
      comm::broadcast(pg, view.shard(u), 0).wait();
      continue;
    }
    if (!buffer.defined() || buffer.dtype() != view.flat_options(u).dtype())
      buffer = torch::empty({largest}, view.flat_options(u));
    const at::Tensor full = buffer.narrow(0, 0, view.padded_numel(u));
    if (root) {
      full.zero_();  // padding
      fill_unit(view, u, full, rank0_dict, piece_of);
    }
    comm::broadcast(pg, full, 0).wait();
    const auto& entries = view.entries(u);
    for (size_t i = 0; i < entries.size(); ++i) {
      const core::detail::LocalPiece& p = *piece_of.at(entries[i].param.unsafeGetTensorImpl());
      if (p.end > p.begin) p.flat().copy_(view.view_of(u, full, i).reshape({-1}).slice(0, p.begin, p.end));
    }
  }
  // Parameters outside every unit (ignored modules): replicated, full shape.
  for (const auto& p : pieces) {
    if (p.unit >= 0) continue;
    if (root) {
      const at::Tensor& src = *find_param(rank0_dict, p);
      p.param.detach().copy_(src.reshape(p.param.sizes()));
      state::detail::release_mapped_pages({src});
    }
    comm::broadcast(pg, p.param.detach(), 0).wait();
  }
  for (const auto& b : view.module().named_buffers()) {
    if (root) {
      const at::Tensor& src = *rank0_dict.find(b.key());
      b.value().copy_(src.reshape(b.value().sizes()));
      state::detail::release_mapped_pages({src});
    }
    comm::broadcast(pg, b.value(), 0).wait();
  }
}

}  // namespace fsdp
