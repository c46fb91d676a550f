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

namespace fsdp::comm::detail {

// The check that every rank built the same thing (a model's parameters, an optimizer's
// parameter list) before any collective depends on it. A rank with another model would
// otherwise reach collectives of other sizes, where a transport may hang, abort, or (a
// broadcast over Gloo) quietly accept a shorter message.

/// What the error says: "<who>: <what_differs> across ranks (seen on rank R): rank r differs
/// from rank 0 at <item> #i: rank 0 has '<line>', this rank has '<line>'. <fix>".
struct SameOnAllRanksText {
  std::string who;   ///< e.g. "fsdp"
  std::string what_differs;  ///< e.g. "the model differs"
  std::string item;  ///< e.g. "parameter"
  std::string fix;   ///< e.g. "Build the same model on every rank before wrapping"
};

/// Every rank compares its `lines` (one per item) with rank 0's. Where any rank differs,
/// every rank raises the same error naming the first rank that differs and its first
/// differing item (never a hang). Two collectives of sizes every rank agrees on, plus
/// rank 0's text; nothing with one rank.
void check_same_on_all_ranks(const ProcessGroup& pg, const std::vector<std::string>& lines,
                             const SameOnAllRanksText& text);

}  // namespace fsdp::comm::detail
