#include "route.h"

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

namespace fsdp::comm::detail {

namespace {

bool same_address(const sockaddr* a, const sockaddr* b) {
  if (a == nullptr || b == nullptr || a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

std::string interface_of(const sockaddr* local) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (same_address(it->ifa_addr, local)) {
      name = it->ifa_name;
      break;
    }
  }
  ::freeifaddrs(list);
  return name;
}

}  // namespace

LocalRoute local_route_to(const std::string& master_addr, int port, int rank) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(master_addr.c_str(), service.c_str(), &hints, &found);
  TORCH_CHECK(rc == 0 && found != nullptr, "fsdp: rank ", rank, ": MASTER_ADDR '", master_addr,
              "' does not resolve (", ::gai_strerror(rc), "); set MASTER_ADDR to rank 0's "
              "address or a resolvable name");
  std::string last_error;
  LocalRoute route;
  for (addrinfo* ai = found; ai != nullptr && route.address.empty(); ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    // connect() on a UDP socket only selects the route and the source address.
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    ::close(fd);
    char host[NI_MAXHOST] = {0};
    if (::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, host, sizeof(host), nullptr, 0,
                      NI_NUMERICHOST) != 0) {
      last_error = "cannot print the local address";
      continue;
    }
    route.address = host;
    route.interface = interface_of(reinterpret_cast<sockaddr*>(&local));
  }
  ::freeaddrinfo(found);
  TORCH_CHECK(!route.address.empty(), "fsdp: rank ", rank, ": no route from this host to MASTER_ADDR ",
              master_addr, " port ", port, " (", last_error, "); check MASTER_ADDR, or set "
              "GLOO_SOCKET_IFNAME to the interface that reaches rank 0's host");
  return route;
}

std::string interface_address(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string v4, v6;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || ifname != it->ifa_name) continue;
    const int family = it->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    char host[NI_MAXHOST] = {0};
    const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (::getnameinfo(it->ifa_addr, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) continue;
    std::string& slot = family == AF_INET ? v4 : v6;
    if (slot.empty()) slot = host;
  }
  ::freeifaddrs(list);
  return v4.empty() ? v6 : v4;
}

bool is_loopback_address(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace fsdp::comm::detail
