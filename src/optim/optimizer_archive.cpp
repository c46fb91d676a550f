#include "optimizer_archive.h"

#include <string>
#include <unordered_map>

namespace fsdp::optim::detail {

namespace {

int64_t read_size(torch::serialize::InputArchive& archive, const std::string& key) {
  torch::Tensor size;
  archive.read(key, size);
  return size.item<int64_t>();
}

}  // namespace

void load_optimizer_archive(torch::serialize::InputArchive& archive, torch::optim::Optimizer& opt,
                            const OptimizerArchiveReaders& read) {
  c10::IValue version;
  archive.read("pytorch_version", version);
  TORCH_CHECK(version.isString() && version.toStringRef() == "1.5.0",
              "optimizer archive: unknown format version ", version,
              " (torch::optim archives since libtorch 1.5 say \"1.5.0\"); it was not written by "
              "torch::save of a torch::optim optimizer");

  // 1. Saved state by its key, as written (hex or decimal).
  torch::serialize::InputArchive state_archive;
  archive.read("state", state_archive);
  std::unordered_map<std::string, std::unique_ptr<torch::optim::OptimizerParamState>> saved;
  for (const std::string& key : state_archive.keys()) {
    torch::serialize::InputArchive one;
    state_archive.read(key, one);
    saved[key] = read.state(one);
  }

  // 2. Groups: each saved key goes to the parameter at its position.
  torch::serialize::InputArchive groups;
  archive.read("param_groups", groups);
  const int64_t n_groups = read_size(groups, "param_groups/size");
  auto& ours = opt.param_groups();
  TORCH_CHECK(n_groups == static_cast<int64_t>(ours.size()), "optimizer archive: it has ", n_groups,
              " parameter groups, the optimizer ", ours.size(), "; build the optimizer with the groups it was saved with");
  for (int64_t g = 0; g < n_groups; ++g) {
    torch::serialize::InputArchive group;
    groups.read("param_groups/" + std::to_string(g), group);
    const int64_t n_params = read_size(group, "params/size");
    const auto& params = ours[g].params();
    TORCH_CHECK(n_params == static_cast<int64_t>(params.size()), "optimizer archive: parameter group ", g,
                " has ", n_params, " parameters in the archive and ", params.size(),
                " in the optimizer; build the optimizer with the parameters it was saved with");
    for (int64_t j = 0; j < n_params; ++j) {
      c10::IValue key;
      group.read("params/" + std::to_string(j), key);
      auto it = saved.find(key.toStringRef());
      if (it != saved.end()) opt.state()[params[j].unsafeGetTensorImpl()] = std::move(it->second);
    }
    torch::serialize::InputArchive options;
    group.read("options", options);
    read.options(static_cast<size_t>(g), options);
  }
}

}  // namespace fsdp::optim::detail
