#pragma once
// The check both readers of a full state dict file make of what they unpickled
// (load_full_state_dict in state_dict.cpp reads the file, map_full_state_dict in
// mapped_state_dict.cpp maps it): the unpickler ran, and its value is a plain dict
// of string keys and tensors. One place, so that both fail with the same words.

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "fsdp/state/state_dict.h"

namespace fsdp::state::detail {

/// The dict `unpickle()` returns, as a StateDict in its order. `fn` (the public
/// function reading `path`) names the caller in the errors: an unpickler error
/// (the 1.13 C++ unpickler rejects an OrderedDict), a value that is not a dict, or
/// an entry that is not string -> tensor; each says how to save a readable file.
StateDict unpickled_state_dict(const char* fn, const std::string& path, const std::function<c10::IValue()>& unpickle);

/// `value` pickled as torch.save pickles it, without TorchScript type tags (see
/// pickle_save_untagged): the pickle's bytes, and the tensors whose storages it refers to as
/// records data/0, data/1, ... in that order.
struct UntaggedPickle {
  std::vector<char> bytes;
  std::vector<at::Tensor> tensors;
};
UntaggedPickle pickle_untagged(const c10::IValue& value);

/// torch::pickle_save's archive (what torch.save writes), pickled without TorchScript type
/// tags: torch::pickle_save tags every dict with torch.jit._pickle.restore_type_tag, which
/// torch.load's default weights_only=True (torch >= 2.6) refuses. libtorch's pickle_load
/// reads either. Lists of int, float, bool or Tensor would still be written with
/// torch.jit._pickle.build_*list: keep them out of what is saved (use generic lists).
std::vector<char> pickle_save_untagged(const c10::IValue& value);

}  // namespace fsdp::state::detail
