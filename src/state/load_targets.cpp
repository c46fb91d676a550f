#include "load_targets.h"

#include <unordered_map>

namespace fsdp::state {

LoadTarget LoadTargets::whole(const std::string& name, const at::Tensor& value) {
  LoadTarget t;
  t.name = name;
  t.shape = value.sizes().vec();
  t.end = value.numel();
  const at::Tensor data = value.detach();
  if (data.is_contiguous()) {
    t.dest = data.view({-1});
  } else {
    t.dest = data.contiguous().view({-1});
    copy_back_.push_back(CopyBack{t.dest, data});
  }
  return t;
}

void LoadTargets::add_buffers(torch::nn::Module& m) {
  for (const auto& b : m.named_buffers()) list_.push_back(whole(b.key(), b.value()));
}

LoadTargets::LoadTargets(const std::vector<core::detail::LocalPiece>& pieces, torch::nn::Module& m) {
  for (const auto& p : pieces) {
    LoadTarget t;
    t.name = p.name;
    t.aliases = p.aliases;
    t.shape = p.shape;
    t.dest = p.flat();
    t.begin = p.begin;
    t.end = p.end;
    t.param = p.param;
    list_.push_back(std::move(t));
  }
  add_buffers(m);
}

LoadTargets::LoadTargets(torch::nn::Module& m) {
  std::unordered_map<const c10::TensorImpl*, size_t> first;
  for (const auto& p : m.named_parameters()) {
    const auto [it, fresh] = first.emplace(p.value().unsafeGetTensorImpl(), list_.size());
    if (fresh) {
      list_.push_back(whole(p.key(), p.value()));
      list_.back().param = p.value();
    } else {
      list_[it->second].aliases.push_back(p.key());
    }
  }
  add_buffers(m);
}

void LoadTargets::finish() const {
  for (const auto& c : copy_back_) c.to.copy_(c.from.view(c.to.sizes()));
}

}  // namespace fsdp::state
