#pragma once
// Internal to src/state: a collective operation's ranks agreeing on failure. Each rank
// passes what went wrong on it ("" for nothing); when any rank failed, every rank throws the
// same words, naming the first rank that failed, so that no rank goes on to a collective
// the others have left.
#include <string>

#include "fsdp/comm/process_group.h"

namespace fsdp::state {

/// Throws "<who> (rank R): rank r failed: <its error>. <consequence>" on every rank when any
/// rank's `error` is not empty. One all-gather of the errors.
void throw_if_any_failed(const comm::ProcessGroup& pg, const std::string& error, const std::string& who,
                         const std::string& consequence);

}  // namespace fsdp::state
