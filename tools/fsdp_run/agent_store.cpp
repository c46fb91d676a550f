#include "agent_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "rank_env.h"  // LauncherError
#include "tcp_listen.h"

namespace fsdp::launcher {

namespace wire = store_wire;
using store_wire::Reader;

namespace {

std::string peer_name(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  } else if (addr.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  }
  std::string h = host;
  if (h.rfind("::ffff:", 0) == 0) h = h.substr(7);  // an IPv4 peer on the dual-stack socket
  return h + ":" + std::to_string(port);
}

}  // namespace

std::unique_ptr<AgentStore> AgentStore::start(int port) {
  std::string error;
  const int fd = listen_any(port, error);
  if (fd < 0) {
    throw LauncherError("cannot serve the agent store on port " + std::to_string(port) +
                        " (MASTER_PORT): " + error + "; choose another --master-port" +
                        std::string(port != 0 ? " on every node" : ""));
  }
  ::fcntl(fd, F_SETFL, O_NONBLOCK);
  std::unique_ptr<AgentStore> store(new AgentStore(fd, local_port(fd)));
  if (::pipe2(store->stop_pipe_, O_CLOEXEC) != 0) {
    throw LauncherError(std::string("agent store: cannot create a pipe: ") + std::strerror(errno));
  }
  // The serving thread must never take a signal: fsdp-run's main thread receives SIGCHLD and
  // the stop signals through its signalfd, which only works if no thread leaves them
  // unblocked (an unblocked SIGTERM would kill fsdp-run outright). A thread inherits the
  // creating thread's mask.
  sigset_t all, previous;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &previous);
  store->thread_ = std::thread(&AgentStore::serve, store.get());
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return store;
}

AgentStore::AgentStore(int listen_fd, int port) : listen_fd_(listen_fd), port_(port) {}

AgentStore::~AgentStore() {
  if (stop_pipe_[1] >= 0) ::close(stop_pipe_[1]);
  if (thread_.joinable()) thread_.join();
  for (auto& [id, c] : clients_) ::close(c.fd);
  if (stop_pipe_[0] >= 0) ::close(stop_pipe_[0]);
  ::close(listen_fd_);
}

void AgentStore::warn(const std::string& line) const {
  const std::string text = "fsdp-run: agent store: " + line + "\n";
  ssize_t ignored = ::write(2, text.data(), text.size());  // one write: never split mid-line
  (void)ignored;
}

void AgentStore::serve() {
  std::vector<pollfd> fds;
  std::vector<std::uint64_t> ids;
  for (;;) {
    // Replies queued while answering (WAITs released by a SET) go out first.
    std::vector<std::uint64_t> broken;
    for (auto& [id, c] : clients_) {
      flush(c);
      if (c.fd < 0) broken.push_back(id);
    }
    for (auto id : broken) drop(id);

    fds.assign({{stop_pipe_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    ids.clear();
    for (auto& [id, c] : clients_) {
      fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      ids.push_back(id);
    }
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      warn(std::string("poll failed: ") + std::strerror(errno) + "; the store stops serving");
      return;
    }
    if (fds[0].revents != 0) return;  // the destructor closed the pipe
    if (fds[1].revents & POLLIN) accept_clients();
    for (std::size_t k = 2; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      const std::uint64_t id = ids[k - 2];
      auto it = clients_.find(id);
      if (it == clients_.end()) continue;
      Client& c = it->second;
      const bool gone = !receive(c);
      // A client may send its last request and close at once (a SET before exiting): answer
      // what arrived before dropping it.
      if (!handle_input(id, c) || gone) drop(id);
    }
  }
}

void AgentStore::accept_clients() {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;  // no more waiting
      // Out of descriptors or memory: the connection stays queued (its client retries until
      // its timeout); pause, or poll() would report it again at once and spin.
      warn(std::string("cannot accept a client: ") + std::strerror(errno) +
           (errno == EMFILE ? " (raise `ulimit -n`)" : ""));
      ::poll(nullptr, 0, 100);
      return;
    }
    int one = 1;  // replies are a few bytes each; do not hold them back
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Client c;
    c.fd = fd;
    c.peer = peer_name(fd);
    clients_.emplace(next_id_++, std::move(c));
  }
}

bool AgentStore::receive(Client& c) {
  char buf[64 * 1024];
  for (;;) {
    const ssize_t n = ::read(c.fd, buf, sizeof(buf));
    if (n > 0) {
      c.in.append(buf, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

bool AgentStore::handle_input(std::uint64_t id, Client& c) {
  std::size_t start = 0;
  for (;;) {
    std::size_t end = start;
    const Parsed parsed = handle_one(id, c, start, end);
    if (parsed == Parsed::Refused) return false;
    if (parsed == Parsed::Incomplete) break;
    start = end;
  }
  c.in.erase(0, start);
  return true;
}

AgentStore::Parsed AgentStore::handle_one(std::uint64_t id, Client& c, std::size_t start,
                                          std::size_t& end) {
  Reader r(c.in, start);
  std::uint8_t type = 0;
  if (!r.value(type)) return Parsed::Incomplete;
  Parsed parsed;
  if (!c.validated) {
    if (type != wire::kValidate) {
      return refuse(c, "sent request type " + std::to_string(type) + " before VALIDATE, the " +
                           "first request of libtorch 2.x's TCPStore protocol (a libtorch 1.x " +
                           "rank? build every rank against libtorch 2.x)");
    }
    parsed = handshake(c, r);
  } else {
    parsed = answer(type, id, c, r);
  }
  if (parsed == Parsed::Done) end = r.pos();
  return parsed;
}

AgentStore::Parsed AgentStore::handshake(Client& c, Reader& r) {
  std::uint32_t magic = 0;
  if (!r.value(magic)) return Parsed::Incomplete;
  if (magic != wire::kValidationMagic) {
    char hex[16];
    std::snprintf(hex, sizeof(hex), "0x%08X", magic);
    return refuse(c, std::string("opened with magic ") + hex + ", not 0x3C85F7CE of the " +
                         "libtorch 2.x TCPStore protocol this store speaks (build every rank " +
                         "against libtorch 2.x)");
  }
  c.validated = true;
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::answer(std::uint8_t type, std::uint64_t id, Client& c, Reader& r) {
  std::string key, value;
  switch (type) {
    case wire::kSet:
      if (!r.bytes(key) || !r.bytes(value)) return shortfall(c, r);
      set_value(key, std::move(value));
      return Parsed::Done;
    case wire::kCompareSet: return on_compare_set(c, r);
    case wire::kGet: return on_get(c, r, false);
    case wire::kMultiGet: return on_get(c, r, true);
    case wire::kAdd: return on_add(c, r);
    case wire::kCheck: {
      std::vector<std::string> keys;
      if (!r.keys(keys)) return shortfall(c, r);
      const bool all = std::all_of(keys.begin(), keys.end(),
                                   [this](const std::string& k) { return present(k); });
      wire::put_value<std::uint8_t>(c.out, all ? wire::kReady : wire::kNotReady);
      return Parsed::Done;
    }
    case wire::kWait: return on_wait(id, c, r);
    case wire::kCancelWait: return on_cancel_wait(id, c);
    case wire::kGetNumKeys:
      wire::put_value<std::int64_t>(c.out, static_cast<std::int64_t>(values_.size()));
      return Parsed::Done;
    case wire::kDeleteKey:
      if (!r.bytes(key)) return shortfall(c, r);
      wire::put_value<std::int64_t>(c.out, static_cast<std::int64_t>(values_.erase(key)));
      return Parsed::Done;
    case wire::kAppend:
      if (!r.bytes(key) || !r.bytes(value)) return shortfall(c, r);
      set_value(key, values_[key] + value);
      return Parsed::Done;
    case wire::kMultiSet: return on_multi_set(c, r);
    case wire::kPing: {
      std::uint32_t nonce = 0;
      if (!r.value(nonce)) return Parsed::Incomplete;
      wire::put_value(c.out, nonce);
      return Parsed::Done;
    }
    case wire::kQueuePush:
      if (!r.bytes(key) || !r.bytes(value)) return shortfall(c, r);
      queues_[key].push_back(std::move(value));
      release_waiters(key, /*all=*/false);  // one pop per push
      return Parsed::Done;
    case wire::kQueuePop: return on_queue_pop(c, r);
    case wire::kQueueLen: {
      if (!r.bytes(key)) return shortfall(c, r);
      auto q = queues_.find(key);
      wire::put_value<std::int64_t>(
          c.out, q == queues_.end() ? 0 : static_cast<std::int64_t>(q->second.size()));
      return Parsed::Done;
    }
    case wire::kListKeys:
      wire::put_value<std::int64_t>(c.out, static_cast<std::int64_t>(values_.size()));
      for (const auto& kv : values_) wire::put_bytes(c.out, kv.first);
      return Parsed::Done;
    case wire::kBarrier: return on_barrier(id, c, r);
    case wire::kValidate: return refuse(c, "sent VALIDATE again (c10d sends it once, first)");
    default:
      return refuse(c, "sent request type " + std::to_string(type) + ", which is not in the " +
                           "libtorch 2.x TCPStore protocol this store speaks (torch 2.11 to " +
                           "2.15; launch with torchrun for a newer client's requests)");
  }
}

AgentStore::Parsed AgentStore::on_compare_set(Client& c, Reader& r) {
  std::string key, expected, desired;
  if (!r.bytes(key) || !r.bytes(expected) || !r.bytes(desired)) return shortfall(c, r);
  auto it = values_.find(key);
  if (it == values_.end()) {
    if (!expected.empty()) {  // nothing stored; c10d replies `expected` all the same
      wire::put_bytes(c.out, expected);
      return Parsed::Done;
    }
    set_value(key, desired);
  } else if (it->second == expected) {
    set_value(key, std::move(desired));
  }
  wire::put_bytes(c.out, values_[key]);
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::on_get(Client& c, Reader& r, bool multi) {
  std::vector<std::string> keys(1);
  if (!(multi ? r.keys(keys) : r.bytes(keys[0]))) return shortfall(c, r);
  std::string reply;
  for (const auto& key : keys) {
    auto it = values_.find(key);
    if (it == values_.end()) {
      // c10d's clients WAIT for keys before they GET them, so only a foreign client lands here.
      return refuse(c, "asked for key '" + key + "', which is not set");
    }
    wire::put_bytes(reply, it->second);
  }
  c.out += reply;
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::on_add(Client& c, Reader& r) {
  std::string key;
  std::int64_t delta = 0;
  if (!r.bytes(key) || !r.value(delta)) return shortfall(c, r);
  std::int64_t sum = 0;
  if (!stored_count(key, sum)) {
    return refuse(c, "added to key '" + key + "', whose value is not a number");
  }
  sum += delta;
  set_value(key, std::to_string(sum));
  wire::put_value<std::int64_t>(c.out, sum);
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::on_wait(std::uint64_t id, Client& c, Reader& r) {
  std::vector<std::string> keys;
  if (!r.keys(keys)) return shortfall(c, r);
  int missing = 0;
  for (const auto& key : keys) {
    if (present(key)) continue;
    waiting_[key].push_back(id);
    ++missing;
  }
  if (missing == 0) {
    wire::put_value<std::uint8_t>(c.out, wire::kStopWaiting);
  } else {
    c.awaited = missing;
  }
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::on_cancel_wait(std::uint64_t id, Client& c) {
  // Sent when the client's WAIT (or BARRIER) timed out. A STOP_WAITING already queued goes
  // out first; the client reads past it.
  forget_waits(id);
  wire::put_value<std::uint8_t>(c.out, wire::kWaitCanceled);
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::on_multi_set(Client& c, Reader& r) {
  std::uint64_t n = 0;
  if (!r.count(n)) return shortfall(c, r);
  std::vector<std::pair<std::string, std::string>> items(static_cast<std::size_t>(n));
  for (auto& [key, value] : items) {
    if (!r.bytes(key) || !r.bytes(value)) return shortfall(c, r);
  }
  // Only a whole request is applied: its first items must not be set again when the rest
  // arrives.
  for (auto& [key, value] : items) set_value(key, std::move(value));
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::on_queue_pop(Client& c, Reader& r) {
  std::string key;
  if (!r.bytes(key)) return shortfall(c, r);
  auto q = queues_.find(key);
  if (q == queues_.end() || q->second.empty()) {
    wire::put_value<std::int64_t>(c.out, 0);  // the client raises QueueEmptyError
    return Parsed::Done;
  }
  wire::put_value<std::int64_t>(c.out, static_cast<std::int64_t>(q->second.size()));
  wire::put_bytes(c.out, q->second.front());
  q->second.pop_front();
  if (q->second.empty()) queues_.erase(q);
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::on_barrier(std::uint64_t id, Client& c, Reader& r) {
  std::string key;
  std::int64_t world_size = 0;
  if (!r.bytes(key) || !r.value(world_size)) return shortfall(c, r);
  std::int64_t arrived = 0;
  if (!stored_count(key, arrived)) {
    return refuse(c, "reached barrier '" + key + "', whose value is not a number");
  }
  ++arrived;
  set_value(key, std::to_string(arrived));
  if (arrived < world_size) {
    barriers_[key].push_back(id);
    return Parsed::Done;
  }
  wire::put_value<std::uint8_t>(c.out, wire::kStopWaiting);
  auto b = barriers_.find(key);
  if (b == barriers_.end()) return Parsed::Done;
  for (std::uint64_t other : b->second) {
    auto o = clients_.find(other);
    if (o != clients_.end()) wire::put_value<std::uint8_t>(o->second.out, wire::kStopWaiting);
  }
  barriers_.erase(b);
  return Parsed::Done;
}

AgentStore::Parsed AgentStore::shortfall(const Client& c, const Reader& r) const {
  if (!r.malformed()) return Parsed::Incomplete;
  return refuse(c, "sent a request announcing more than 1 GiB or 2^20 items, which no "
                   "TCPStore client sends");
}

AgentStore::Parsed AgentStore::refuse(const Client& c, const std::string& why) const {
  warn("client " + c.peer + " " + why + "; disconnecting it");
  return Parsed::Refused;
}

bool AgentStore::stored_count(const std::string& key, std::int64_t& n) const {
  n = 0;
  auto it = values_.find(key);
  if (it == values_.end()) return true;
  const std::string& text = it->second;
  errno = 0;
  char* stop = nullptr;
  n = std::strtoll(text.c_str(), &stop, 10);
  return errno == 0 && !text.empty() && stop == text.c_str() + text.size();
}

bool AgentStore::present(const std::string& key) const {
  if (values_.count(key) > 0) return true;
  auto q = queues_.find(key);
  return q != queues_.end() && !q->second.empty();
}

void AgentStore::set_value(const std::string& key, std::string value) {
  values_[key] = std::move(value);
  release_waiters(key, /*all=*/true);
}

void AgentStore::release_waiters(const std::string& key, bool all) {
  auto it = waiting_.find(key);
  if (it == waiting_.end()) return;
  std::vector<std::uint64_t> released;
  if (all) {
    released.swap(it->second);
  } else {
    released.push_back(it->second.front());
    it->second.erase(it->second.begin());
  }
  if (it->second.empty()) waiting_.erase(it);
  for (std::uint64_t id : released) count_released(id);
}

void AgentStore::count_released(std::uint64_t id) {
  auto c = clients_.find(id);
  if (c != clients_.end() && --c->second.awaited == 0) {
    wire::put_value<std::uint8_t>(c->second.out, wire::kStopWaiting);
  }
}

void AgentStore::forget_waits(std::uint64_t id) {
  for (auto* lists : {&waiting_, &barriers_}) {
    for (auto w = lists->begin(); w != lists->end();) {
      auto& ids = w->second;
      ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
      w = ids.empty() ? lists->erase(w) : std::next(w);
    }
  }
  auto c = clients_.find(id);
  if (c != clients_.end()) c->second.awaited = 0;
}

void AgentStore::flush(Client& c) {
  while (!c.out.empty()) {
    const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n > 0) {
      c.out.erase(0, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;  // POLLOUT resumes it
    ::close(c.fd);  // the client is gone; drop() forgets it
    c.fd = -1;
    return;
  }
}

void AgentStore::drop(std::uint64_t id) {
  auto it = clients_.find(id);
  if (it == clients_.end()) return;
  if (it->second.fd >= 0) ::close(it->second.fd);
  forget_waits(id);
  clients_.erase(it);
}

}  // namespace fsdp::launcher
