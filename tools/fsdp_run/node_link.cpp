#include "node_link.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>

#include "tcp_listen.h"

namespace fsdp::launcher {

namespace {

using Clock = std::chrono::steady_clock;

std::string hostname() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<long long>(0, left.count()));
}

void write_line(int fd, const std::string& line) {
  std::string text = line + "\n";
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    // MSG_NOSIGNAL: a peer that already left must not kill us with SIGPIPE.
    ssize_t n = ::send(fd, p, left, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the peer is gone; its loss is noticed on the reading side
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

/// Reads one line from fd before the deadline (buffer keeps what follows it); nullopt on EOF,
/// error or timeout.
std::optional<std::string> read_line(int fd, std::string& buffer, Clock::time_point deadline) {
  while (true) {
    auto nl = buffer.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer.substr(0, nl);
      buffer.erase(0, nl + 1);
      return line;
    }
    pollfd p{fd, POLLIN, 0};
    int ready = ::poll(&p, 1, ms_left(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return std::nullopt;
    char buf[4096];
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    buffer.append(buf, static_cast<std::size_t>(n));
  }
}

std::string seconds_text(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

int listen_on(int port) {
  std::string error;
  const int fd = listen_any(port, error);
  if (fd < 0) {
    throw LauncherError("node 0: cannot listen on port " + std::to_string(port) +
                        " for the other nodes' launchers (MASTER_PORT+1): " + error +
                        "; choose another --master-port on every node");
  }
  return fd;
}

/// One connection attempt to addr:port; -1 with `error` set on failure.
int connect_once(const std::string& addr, int port, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) {
    error = std::string("cannot resolve: ") + ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  return fd;
}

void enable_keepalive(int fd) {
  // A peer host that vanishes without closing (link cut, power loss) is noticed in ~9 s when
  // the connection is idle (keepalive), and in 10 s when a message to it is unacknowledged
  // (TCP_USER_TIMEOUT; by default the kernel retransmits for ~15 minutes).
  int one = 1, idle = 3, interval = 2, count = 3;
  unsigned int user_timeout_ms = 10000;
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

}  // namespace

NodeLink::NodeLink(JobTopology job, std::vector<Peer> peers)
    : job_(std::move(job)), peers_(std::move(peers)) {}

NodeLink::~NodeLink() {
  for (auto& p : peers_) {
    if (p.fd >= 0) ::close(p.fd);
  }
}

std::unique_ptr<NodeLink> NodeLink::establish(const JobTopology& job, const std::string& master_addr,
                                              int port, double timeout_seconds) {
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<long long>(timeout_seconds * 1000.0));
  const std::string me = hostname();
  std::vector<Peer> peers;
  auto close_all = [&peers] {
    for (auto& p : peers) {
      if (p.fd >= 0) ::close(p.fd);
    }
  };

  if (job.node_rank != 0) {
    std::string error = "not tried";
    int fd = -1;
    while (fd < 0) {
      fd = connect_once(master_addr, port, error);
      if (fd >= 0) break;
      if (Clock::now() >= deadline) {
        throw LauncherError("node " + std::to_string(job.node_rank) + ": cannot reach node 0's launcher at " +
                            master_addr + ":" + std::to_string(port) + " (MASTER_PORT+1) within " +
                            seconds_text(timeout_seconds) + " s (" + error + "); start fsdp-run " +
                            "--node-rank 0 there with the same --master-port, or fix --master-addr");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    enable_keepalive(fd);
    Peer master;
    master.fd = fd;
    master.node_rank = 0;
    master.host = master_addr;
    write_line(fd, "hello " + std::to_string(job.nnodes) + " " + std::to_string(job.nproc_per_node) +
                       " " + std::to_string(job.node_rank) + " " + me + " " + std::to_string(job.max_restarts));
    auto reply = read_line(fd, master.buffer, deadline);
    if (!reply) {
      ::close(fd);
      throw LauncherError("node " + std::to_string(job.node_rank) + ": node 0's launcher at " +
                          master_addr + ":" + std::to_string(port) +
                          " did not let this node in within the rendezvous timeout (" +
                          seconds_text(timeout_seconds) + " s): are all " + std::to_string(job.nnodes) +
                          " nodes started?");
    }
    if (*reply != "go") {
      ::close(fd);
      std::string why = reply->rfind("refuse ", 0) == 0 ? reply->substr(7) : "unexpected reply '" + *reply + "'";
      throw LauncherError("node 0 refused this node: " + why);
    }
    peers.push_back(std::move(master));
    return std::unique_ptr<NodeLink>(new NodeLink(job, std::move(peers)));
  }

  // Node 0: accept every other node, check that all agree, then let them all in.
  if (job.nnodes == 1) return std::unique_ptr<NodeLink>(new NodeLink(job, {}));
  const int listener = listen_on(port);
  auto refuse_all = [&](const std::string& why) {
    for (auto& p : peers) write_line(p.fd, "refuse " + why);
    close_all();
    ::close(listener);
    throw LauncherError(why);
  };
  std::map<int, std::string> host_of{{0, me + " (node 0, this launcher)"}};
  while (static_cast<int>(peers.size()) < job.nnodes - 1) {
    pollfd p{listener, POLLIN, 0};
    int ready = ::poll(&p, 1, ms_left(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      std::string missing;
      for (int r = 1; r < job.nnodes; ++r) {
        if (!host_of.count(r)) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      refuse_all("node 0: only " + std::to_string(peers.size()) + " of the " +
                 std::to_string(job.nnodes - 1) + " other nodes joined within " +
                 seconds_text(timeout_seconds) + " s (missing node ranks: " + missing +
                 "); start fsdp-run on every node with --master-addr pointing at this host");
    }
    int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    enable_keepalive(fd);
    Peer peer;
    peer.fd = fd;
    auto hello = read_line(fd, peer.buffer, std::min(deadline, Clock::now() + std::chrono::seconds(10)));
    std::istringstream in(hello.value_or(""));
    std::string word;
    int nnodes = 0, nproc = 0, node_rank = -1, max_restarts = -1;
    if (!(in >> word >> nnodes >> nproc >> node_rank >> peer.host >> max_restarts) || word != "hello") {
      ::close(fd);  // not an fsdp-run of this job (a port scan, a stale client): ignore it
      continue;
    }
    peer.node_rank = node_rank;
    peers.push_back(std::move(peer));
    const std::string who = "the launcher on " + peers.back().host + " (--node-rank " +
                            std::to_string(node_rank) + ")";
    if (nnodes != job.nnodes || nproc != job.nproc_per_node) {
      refuse_all("nodes disagree: " + who + " has --nnodes " + std::to_string(nnodes) + " --nproc " +
                 std::to_string(nproc) + ", node 0 (" + me + ") has --nnodes " + std::to_string(job.nnodes) +
                 " --nproc " + std::to_string(job.nproc_per_node) + "; give every node the same values");
    }
    if (max_restarts != job.max_restarts) {
      refuse_all("nodes disagree: " + who + " has --max-restarts " + std::to_string(max_restarts) +
                 ", node 0 (" + me + ") has --max-restarts " + std::to_string(job.max_restarts) +
                 "; give every node the same value (all nodes restart together)");
    }
    if (node_rank < 1 || node_rank >= job.nnodes) {
      refuse_all(who + ": node rank " + std::to_string(node_rank) + " is outside 1.." +
                 std::to_string(job.nnodes - 1));
    }
    if (host_of.count(node_rank)) {
      refuse_all("node rank " + std::to_string(node_rank) + " claimed twice: by " + host_of[node_rank] +
                 " and by " + peers.back().host + "; give each node its own --node-rank 0.." +
                 std::to_string(job.nnodes - 1));
    }
    host_of[node_rank] = peers.back().host;
  }
  ::close(listener);
  for (auto& p : peers) write_line(p.fd, "go");
  return std::unique_ptr<NodeLink>(new NodeLink(job, std::move(peers)));
}

std::vector<int> NodeLink::fds() const {
  std::vector<int> out;
  for (const auto& p : peers_) {
    if (!p.closed) out.push_back(p.fd);
  }
  return out;
}

std::string NodeLink::describe(const Peer& peer) const {
  const int first = peer.node_rank * job_.nproc_per_node;
  const int last = first + job_.nproc_per_node - 1;
  const std::string ranks = first == last ? "rank " + std::to_string(first)
                                          : "ranks " + std::to_string(first) + "-" + std::to_string(last);
  return "node " + std::to_string(peer.node_rank) + " (" + peer.host + ", " + ranks + ")";
}

void NodeLink::send_to(Peer& peer, const std::string& line) {
  if (!peer.closed) write_line(peer.fd, line);
}

std::optional<std::string> NodeLink::take_lines(Peer& peer) {
  std::optional<std::string> failure;
  // Stop after a verdict: what follows belongs to the next attempt ([Note: restart together]).
  while (verdict_ == Verdict::None) {
    const auto nl = peer.buffer.find('\n');
    if (nl == std::string::npos) break;
    std::string line = peer.buffer.substr(0, nl);
    peer.buffer.erase(0, nl + 1);
    if (line == "done") {
      peer.done = true;
    } else if (line == "stopped") {
      peer.stopped = true;
    } else if (line == "exit") {
      peer.exited = true;
    } else if (line == "end" && !is_node0()) {
      verdict_ = Verdict::End;
    } else if (line.rfind("restart ", 0) == 0 && !is_node0()) {
      verdict_attempt_ = std::atoi(line.c_str() + 8);
      verdict_ = Verdict::Restart;
    } else if (line.rfind("fail ", 0) == 0 && !failure) {
      failure = line.substr(5);
    }
  }
  // Node 0 passes a node's failure on to every other node.
  if (failure && is_node0()) {
    for (auto& other : peers_) {
      if (&other != &peer) send_to(other, "fail " + *failure);
    }
  }
  return failure;
}

std::optional<std::string> NodeLink::on_readable(int fd) {
  auto it = std::find_if(peers_.begin(), peers_.end(), [fd](const Peer& p) { return p.fd == fd; });
  if (it == peers_.end() || it->closed) return std::nullopt;
  Peer& peer = *it;
  char buf[4096];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  if (n > 0) peer.buffer.append(buf, static_cast<std::size_t>(n));
  std::optional<std::string> failure = take_lines(peer);
  if (n <= 0 && !(n < 0 && errno == EAGAIN)) {
    peer.closed = true;
    ::close(peer.fd);
    peer.fd = -1;
    // A launcher that announced its exit ("exit", or node 0's "end") closes as a matter of
    // course; any other close is a loss.
    peer.lost = !peer.exited && verdict_ != Verdict::End;
    if (peer.lost && !failure) {
      failure = describe(peer) + ": its launcher is gone (connection closed" +
                std::string(n < 0 ? ": " + std::string(std::strerror(errno)) : "") + ")";
      if (is_node0()) {
        for (auto& other : peers_) {
          if (&other != &peer) send_to(other, "fail " + *failure);
        }
      }
    }
  }
  return failure;
}

std::optional<std::string> NodeLink::pending() {
  std::optional<std::string> failure;
  for (auto& peer : peers_) {
    auto f = take_lines(peer);
    if (f && !failure) failure = f;
  }
  return failure;
}

void NodeLink::report_failure(const std::string& what) {
  const std::string line = "fail node " + std::to_string(job_.node_rank) + " (" + hostname() + "): " + what;
  for (auto& p : peers_) send_to(p, line);
}

void NodeLink::report_done() {
  for (auto& p : peers_) send_to(p, "done");
}

void NodeLink::report_stopped() {
  for (auto& p : peers_) send_to(p, "stopped");
}

void NodeLink::report_exit() {
  for (auto& p : peers_) send_to(p, "exit");
}

bool NodeLink::peers_ended() const {
  if (!is_node0()) return true;
  return std::all_of(peers_.begin(), peers_.end(),
                     [](const Peer& p) { return p.done || p.stopped || p.exited || p.closed; });
}

bool NodeLink::lost_any() const {
  return std::any_of(peers_.begin(), peers_.end(), [](const Peer& p) { return p.lost; });
}

bool NodeLink::departed_any() const {
  return std::any_of(peers_.begin(), peers_.end(), [](const Peer& p) { return p.lost || p.exited; });
}

std::string NodeLink::departed_nodes() const {
  std::string lost, exited;
  for (const auto& p : peers_) {
    if (p.lost) lost += (lost.empty() ? "" : ", ") + describe(p);
    if (p.exited) exited += (exited.empty() ? "" : ", ") + describe(p);
  }
  return lost.empty() ? exited : lost;
}

void NodeLink::announce_restart(int attempt) {
  for (auto& p : peers_) send_to(p, "restart " + std::to_string(attempt));
}

void NodeLink::announce_end() {
  for (auto& p : peers_) send_to(p, "end");
}

void NodeLink::begin_attempt() {
  for (auto& p : peers_) {
    p.done = false;
    p.stopped = false;
  }
  verdict_ = Verdict::None;
  verdict_attempt_ = -1;
}

void NodeLink::leave() {
  for (auto& p : peers_) {
    if (p.closed) continue;
    ::close(p.fd);
    p.fd = -1;
    p.closed = true;
  }
}

}  // namespace fsdp::launcher
