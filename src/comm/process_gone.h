#pragma once
// Whether a process on this host has exited: the check behind "gone: rank N"
// in timeout and peer-failure messages.

#include <sys/types.h>

namespace fsdp::comm::detail {

/// True when `pid` no longer runs: it does not exist, or it has exited and waits
/// to be reaped (a zombie). kill(pid, 0) alone still finds a zombie, and a peer
/// that dies under a launcher stays one until the launcher reaps it; Gloo reports
/// the broken connection within milliseconds, long before that, so without the
/// zombie check the message could not name the rank that died.
bool process_gone(pid_t pid);

}  // namespace fsdp::comm::detail
