#pragma once
/// Optimizer state dicts of a FullyShardedDataParallel (PyTorch's
/// full_optim_state_dict family) for torch::optim::Adam, AdamW, SGD and
/// fsdp::optim::CPUAdam.
///
/// [Note: OptimStateDict]
/// The C++ mirror of PyTorch's optimizer state dict layout:
///   {"state": {key: {"step": <int64 scalar tensor>, "exp_avg": T, "exp_avg_sq": T, ...}},
///    "param_groups": [{"lr": float, "params": [key, ...]}, ...]}
/// where key is the parameter's name in the unwrapped model (or, after
/// rekey_optim_state_dict(..., ByPosition), its position "0", "1", ... in the
/// optimizer's parameter list, the C++ meaning of PyTorch's "parameter id").
/// A *full* one holds full-shape tensors; a *sharded* one this rank's pieces
/// (1-D, elements [begin, end) of the flattened parameter, as in
/// [Note: checkpoint records]). save_optim_state_dict writes a full one as a plain
/// Python dict of that layout (torch.load-able; keys are strings).
///
///     auto osd = fsdp::full_optim_state_dict(*model, opt);            // collective; rank 0 holds it
///     ...
///     fsdp::scatter_full_optim_state_dict(osd, *model, opt);          // collective; rank 0's osd used
///     // or, with the full dict on every rank:
///     fsdp::load_optim_state_dict(*model, opt, fsdp::shard_full_optim_state_dict(osd, *model));
///
/// Loading replaces each parameter's state under its own TensorImpl key, so the
/// next step continues from the loaded moments.

#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "fsdp/core/fully_sharded.h"

namespace fsdp {

struct OptimStateDict {
  struct Group {
    double lr = 0;
    std::vector<std::string> params;  // keys
  };
  std::map<std::string, std::map<std::string, at::Tensor>> state;
  std::vector<Group> param_groups;
  bool empty() const { return state.empty() && param_groups.empty(); }
};

/// Gathers the optimizer state to full shapes, unit by unit. Collective. With
/// rank0_only (default) the other ranks return an empty dict.
OptimStateDict full_optim_state_dict(FullyShardedBase& model, const torch::optim::Optimizer& opt,
                                     bool rank0_only = true);

/// This rank's pieces of a full (name-keyed) optimizer state dict. Not collective.
OptimStateDict shard_full_optim_state_dict(const OptimStateDict& full, FullyShardedBase& model);

/// Rank 0's full dict, broadcast unit by unit; every rank keeps its pieces and
/// loads them into `opt`. Collective; other ranks pass an empty dict.
void scatter_full_optim_state_dict(const OptimStateDict& full_on_rank0, FullyShardedBase& model,
                                   torch::optim::Optimizer& opt);

/// Loads a sharded (name-keyed) dict of this rank's pieces into `opt`.
void load_optim_state_dict(FullyShardedBase& model, torch::optim::Optimizer& opt, const OptimStateDict& sharded);

enum class OptimKey {
  kByName,
  kByPosition,
  ByName [[deprecated("use kByName")]] = kByName,
  ByPosition [[deprecated("use kByPosition")]] = kByPosition,
};
/// Re-keys between parameter names and positions in `opt`'s parameter list.
OptimStateDict rekey_optim_state_dict(const OptimStateDict& osd, OptimKey to, FullyShardedBase& model,
                                      const torch::optim::Optimizer& opt);

/// Plain-dict files (torch.load-able; torch.save(dict) from Python loads back).
void save_optim_state_dict(const OptimStateDict& osd, const std::string& path);
OptimStateDict load_optim_state_dict_file(const std::string& path);

}  // namespace fsdp
