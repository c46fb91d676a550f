// [Note: loading safetensors] in include/fsdp/state/safetensors.h.
#include "fsdp/state/safetensors.h"

#include <memory>

#include <torch/torch.h>

#include "agreed_failure.h"
#include "core/state_view.h"
#include "error_message.h"
#include "fsdp/comm/call_label.h"
#include "safetensors_match.h"
#include "safetensors_source.h"

namespace fsdp {

namespace safetensors_load_detail {

using state::LoadTarget;

int64_t apply_rule(const state::SafetensorsSource& source, const TensorRule& rule, size_t k,
                   const std::vector<size_t>& targets, const std::vector<LoadTarget>& list) {
  int64_t bytes = 0;
  std::vector<at::Tensor> inputs;
  for (const auto& f : rule.from) {
    const auto& t = *source.find(f);
    inputs.push_back(source.read_whole(t));
    bytes += t.entry->end - t.entry->begin;
  }
  const std::vector<at::Tensor> outputs = rule.fn(inputs);
  TORCH_CHECK(outputs.size() == rule.to.size(), "fsdp: load_safetensors: rule #", k, " returned ", outputs.size(),
              " tensors for ", rule.to.size(), " names in `to`");
  for (size_t j = 0; j < outputs.size(); ++j) {
    const LoadTarget& t = list[targets[j]];
    TORCH_CHECK(outputs[j].sizes() == c10::IntArrayRef(t.shape), "fsdp: load_safetensors: rule #", k, " made '",
                rule.to[j], "' of shape ", outputs[j].sizes(), ", the model's is ", c10::IntArrayRef(t.shape));
    t.dest.copy_(outputs[j].reshape({-1}).slice(0, t.begin, t.end));
  }
  return bytes;
}

int64_t read_matched(const state::SafetensorsSource& source, const state::NameMatch& match,
                     const state::LoadTargets& targets, const SafetensorsLoadOptions& options) {
  torch::NoGradGuard no_grad;
  int64_t bytes = 0;
  for (const auto& d : match.direct) {
    const LoadTarget& t = targets.list()[d.target];
    bytes += source.read_range(*source.find(d.file_name), t.begin, t.end, t.dest);
  }
  for (const auto& r : match.rules)
    bytes += apply_rule(source, options.rules[r.rule], r.rule, r.targets, targets.list());
  targets.finish();
  return bytes;
}

void check_match(const std::string& path, const state::NameMatch& match) {
  TORCH_CHECK(match.error.empty(), "fsdp: load_safetensors: '", path, "': ", match.error);
}

SafetensorsLoadResult result_of(const state::NameMatch& match, int64_t bytes) {
  SafetensorsLoadResult r;
  r.missing_keys = match.missing;
  r.unexpected_keys = match.unexpected;
  r.bytes_read = bytes;
  return r;
}

std::vector<at::Tensor> one(at::Tensor t) { return {std::move(t)}; }

}  // namespace safetensors_load_detail

TensorRule transpose_rule(std::string from, std::string to) {
  TensorRule r{{from}, {std::move(to)}, nullptr};
  r.fn = [from](const std::vector<at::Tensor>& in) {
    TORCH_CHECK(in[0].dim() == 2, "fsdp: transpose_rule: '", from, "' has ", in[0].dim(), " dimensions, not 2");
    return safetensors_load_detail::one(in[0].t().contiguous());
  };
  return r;
}

TensorRule split_rule(std::string from, std::vector<std::string> to, int64_t dim) {
  const int64_t parts = static_cast<int64_t>(to.size());
  TensorRule r{{from}, std::move(to), nullptr};
  r.fn = [from, parts, dim](const std::vector<at::Tensor>& in) {
    TORCH_CHECK(parts > 0 && in[0].dim() > 0 && in[0].size(dim) % parts == 0, "fsdp: split_rule: '", from,
                "' has size ", in[0].dim() > 0 ? in[0].size(dim) : 0, " in dimension ", dim,
                ", which does not split into ", parts, " equal parts");
    std::vector<at::Tensor> out;
    for (const auto& c : in[0].chunk(parts, dim)) out.push_back(c.contiguous());
    return out;
  };
  return r;
}

TensorRule concat_rule(std::vector<std::string> from, std::string to, int64_t dim) {
  TensorRule r{std::move(from), {std::move(to)}, nullptr};
  r.fn = [dim](const std::vector<at::Tensor>& in) { return safetensors_load_detail::one(at::cat(in, dim)); };
  return r;
}

SafetensorsLoadResult load_safetensors(FullyShardedBase& model, const std::string& path,
                                       const SafetensorsLoadOptions& options) {
  namespace d = safetensors_load_detail;
  comm::LabelScope label_scope({comm::Phase::kStateDict, "load_safetensors"});
  core::detail::StateView view(model);
  const comm::ProcessGroup& pg = view.group();
  const std::vector<core::detail::LocalPiece> pieces = view.local_pieces("load_safetensors");
  // Phase 1, every rank on its own: open the source and match names; nothing is read yet.
  std::unique_ptr<state::SafetensorsSource> source;
  const state::LoadTargets targets(pieces, view.module());
  state::NameMatch match;
  std::string error = state::failure_of([&] {
    source = std::make_unique<state::SafetensorsSource>(path);
    match = state::match_names(*source, targets.list(), options);
    d::check_match(path, match);
  });
  state::throw_if_any_failed(pg, error, "fsdp: load_safetensors", "Nothing was loaded on any rank");
  // Phase 2: each rank reads its own pieces.
  int64_t bytes = 0;
  error = state::failure_of([&] { bytes = d::read_matched(*source, match, targets, options); });
  state::throw_if_any_failed(pg, error, "fsdp: load_safetensors",
                             "The model holds partly loaded values: load again, or restart");
  return d::result_of(match, bytes);
}

SafetensorsLoadResult load_safetensors(torch::nn::Module& model, const std::string& path,
                                       const SafetensorsLoadOptions& options) {
  namespace d = safetensors_load_detail;
  const state::SafetensorsSource source(path);
  const state::LoadTargets targets(model);
  const state::NameMatch match = state::match_names(source, targets.list(), options);
  d::check_match(path, match);
  return d::result_of(match, d::read_matched(source, match, targets, options));
}

}  // namespace fsdp
