#pragma once
// The check both readers of a full state dict file make of what they unpickled
// (load_full_state_dict in state_dict.cpp reads the file, map_full_state_dict in
// mapped_state_dict.cpp maps it): the unpickler ran, and its value is a plain dict
// of string keys and tensors. One place, so that both fail with the same words.

#include <functional>
#include <string>

#include <ATen/core/ivalue.h>

#include "fsdp/state/state_dict.h"

namespace fsdp::detail {

/// The dict `unpickle()` returns, as a StateDict in its order. `fn` (the public
/// function reading `path`) names the caller in the errors: an unpickler error
/// (the 1.13 C++ unpickler rejects an OrderedDict), a value that is not a dict, or
/// an entry that is not string -> tensor; each says how to save a readable file.
StateDict unpickled_state_dict(const char* fn, const std::string& path, const std::function<c10::IValue()>& unpickle);

}  // namespace fsdp::detail
