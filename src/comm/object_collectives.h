#pragma once
// Byte strings over collectives (the library's small control messages: model
// descriptions, checkpoint metadata, optimizer-state layouts), as
// torch.distributed's broadcast_object_list / all_gather_object do for Python
// objects. Callers serialise (text, JSON) themselves. Each call is two
// collectives on `pg` (a length, then the bytes), issued in the same order on
// every rank; with one rank nothing is sent.

#include <string>
#include <vector>

#include "fsdp/comm/call_label.h"
#include "fsdp/comm/process_group.h"

namespace fsdp::comm {

/// Rank `root`'s `bytes`, on every rank (other ranks' `bytes` are ignored).
std::string broadcast_object(const ProcessGroup& pg, const std::string& bytes, int root = 0,
                             const CallLabel& label = {});

/// Every rank's `bytes`, indexed by rank, on every rank.
std::vector<std::string> all_gather_object(const ProcessGroup& pg, const std::string& bytes,
                                           const CallLabel& label = {});

}  // namespace fsdp::comm
