#pragma once
/// Which local address a rank advertises to Gloo peers when GLOO_SOCKET_IFNAME is unset and
/// the rendezvous is on another machine. Gloo's default (the address the hostname resolves
/// to) is loopback wherever the hostname is not in DNS, and a rank advertising 127.0.0.1 to
/// another host makes every peer connect to itself: the job hangs for the whole timeout.
/// The address the kernel would use to reach MASTER_ADDR is, by construction, one the
/// master's host (and any host on the same network) can reach back.

#include <string>

namespace fsdp::comm::detail {

struct LocalRoute {
  std::string address;    // numeric IPv4/IPv6 address of this host, e.g. "10.77.0.2"
  std::string interface;  // the interface holding it, e.g. "eth0" ("" if not found)
};

/// The local end of a route to master_addr:port (no packet is sent: a UDP socket is
/// connected and asked for its local address). Throws c10::Error naming the address, the
/// port and the fix when master_addr does not resolve or no route leads there.
LocalRoute local_route_to(const std::string& master_addr, int port, int rank);

/// The first IPv4 (else IPv6) address of interface `ifname` (GLOO_SOCKET_IFNAME), numeric;
/// "" if it has none. Only used to tell peers what this rank advertises.
std::string interface_address(const std::string& ifname);

/// True for 127.0.0.0/8, ::1 and "localhost": an address only this host can reach.
bool is_loopback_address(const std::string& addr);

}  // namespace fsdp::comm::detail
