#pragma once
/// The listening sockets fsdp-run opens: node 0's launcher link (MASTER_PORT+1) and, with
/// --max-restarts, the agent store (MASTER_PORT).

#include <string>

namespace fsdp::launcher {

/// Listens on `port` (0: a free one) on every interface, IPv6 and IPv4 alike, so that peers
/// on other hosts can connect whatever address MASTER_ADDR names. Close-on-exec: no rank
/// inherits it. Returns the socket, or -1 with `error` set to strerror of what failed.
int listen_any(int port, std::string& error);

/// The local port a bound socket listens on (for port 0), or -1.
int local_port(int fd);

}  // namespace fsdp::launcher
