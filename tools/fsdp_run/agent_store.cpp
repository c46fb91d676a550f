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
#include <cstdlib>
#include <cstring>

#include "rank_env.h"  // LauncherError
#include "tcp_listen.h"

namespace fsdp::launcher {

namespace {

// Request types of libtorch 1.13's TCPStore (c10d's QueryType enum, in its order).
enum Request : std::uint8_t {
  kSet = 0,
  kCompareSet = 1,
  kGet = 2,
  kAdd = 3,
  kCheck = 4,
  kWait = 5,
  kGetNumKeys = 6,
  kWatchKey = 7,
  kDeleteKey = 8,
};
constexpr std::uint8_t kReady = 0, kNotReady = 1;  // CHECK replies
constexpr std::uint8_t kStopWaiting = 0;            // WAIT reply

// Bounds on what one request may announce, so a stray client (a port scan, another
// protocol) cannot make the launcher allocate without limit; real requests are far smaller.
constexpr std::uint64_t kMaxItemBytes = std::uint64_t{1} << 30;
constexpr std::uint64_t kMaxKeysPerRequest = std::uint64_t{1} << 20;

/// Reads the arguments of one request from a buffer that may not hold all of it yet. Every
/// getter returns false when the bytes are not there (yet); `malformed` says whether they
/// never will be.
class Reader {
 public:
  Reader(const std::string& buf, std::size_t pos) : buf_(buf), pos_(pos) {}
  std::size_t pos() const { return pos_; }
  bool malformed() const { return malformed_; }

  template <typename T>
  bool value(T& out) {
    if (buf_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(&out, buf_.data() + pos_, sizeof(T));  // c10d sends native (x86-64: LE) bytes
    pos_ += sizeof(T);
    return true;
  }
  bool bytes(std::string& out) {
    std::uint64_t n = 0;
    const std::size_t start = pos_;
    if (!value(n)) return false;
    if (n > kMaxItemBytes) {
      malformed_ = true;
      return false;
    }
    if (buf_.size() - pos_ < n) {
      pos_ = start;
      return false;
    }
    out.assign(buf_, pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return true;
  }
  bool keys(std::vector<std::string>& out) {
    std::uint64_t n = 0;
    if (!value(n)) return false;
    if (n > kMaxKeysPerRequest) {
      malformed_ = true;
      return false;
    }
    out.resize(static_cast<std::size_t>(n));
    for (auto& key : out) {
      if (!bytes(key)) return false;
    }
    return true;
  }

 private:
  const std::string& buf_;
  std::size_t pos_;
  bool malformed_ = false;
};

template <typename T>
void append_value(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void append_bytes(std::string& out, const std::string& v) {
  append_value<std::uint64_t>(out, v.size());
  out += v;
}

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
      bool gone = false;
      char buf[64 * 1024];
      for (;;) {
        const ssize_t n = ::read(c.fd, buf, sizeof(buf));
        if (n > 0) {
          c.in.append(buf, static_cast<std::size_t>(n));
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        gone = n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
        break;
      }
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
    clients_.emplace(next_id_++, std::move(c));
  }
}

bool AgentStore::handle_input(std::uint64_t id, Client& c) {
  std::size_t start = 0;
  for (;;) {
    std::size_t end = start;
    const Parsed parsed = handle_one(id, c, start, end);
    if (parsed == Parsed::Malformed) return false;
    if (parsed == Parsed::Incomplete) break;
    start = end;
  }
  c.in.erase(0, start);
  return true;
}

AgentStore::Parsed AgentStore::handle_one(std::uint64_t id, Client& c, std::size_t start,
                                          std::size_t& end) {
  Reader r(c.in, start);
  auto incomplete = [&] {
    if (!r.malformed()) return Parsed::Incomplete;
    warn("client " + peer_name(c.fd) + " sent a request announcing more than 1 GiB or 2^20 "
         "keys, which is not libtorch 1.13's TCPStore protocol; disconnecting it");
    return Parsed::Malformed;
  };
  std::uint8_t type = 0;
  if (!r.value(type)) return Parsed::Incomplete;
  switch (type) {
    case kSet: {
      std::string key, value;
      if (!r.bytes(key) || !r.bytes(value)) return incomplete();
      set_value(key, std::move(value));
      break;
    }
    case kCompareSet: {
      std::string key, expected, desired;
      if (!r.bytes(key) || !r.bytes(expected) || !r.bytes(desired)) return incomplete();
      auto it = values_.find(key);
      std::string now;
      if (it == values_.end()) {
        if (expected.empty()) {
          now = desired;
          set_value(key, std::move(desired));
        } else {
          now = expected;
        }
      } else {
        if (it->second == expected) it->second = std::move(desired);
        now = it->second;
      }
      append_bytes(c.out, now);
      break;
    }
    case kGet: {
      std::string key;
      if (!r.bytes(key)) return incomplete();
      auto it = values_.find(key);
      if (it == values_.end()) {
        // c10d's clients WAIT for a key before they GET it, so only a foreign client lands here.
        warn("client " + peer_name(c.fd) + " asked for key '" + key +
             "', which is not set; disconnecting it");
        return Parsed::Malformed;
      }
      append_bytes(c.out, it->second);
      break;
    }
    case kAdd: {
      std::string key;
      std::int64_t delta = 0;
      if (!r.bytes(key) || !r.value(delta)) return incomplete();
      std::int64_t sum = delta;
      auto it = values_.find(key);
      if (it != values_.end()) {
        errno = 0;
        char* stop = nullptr;
        const long long old = std::strtoll(it->second.c_str(), &stop, 10);
        if (errno != 0 || it->second.empty() || stop != it->second.c_str() + it->second.size()) {
          warn("client " + peer_name(c.fd) + " added to key '" + key +
               "', whose value is not a number; disconnecting it");
          return Parsed::Malformed;
        }
        sum += old;
      }
      set_value(key, std::to_string(sum));
      append_value<std::int64_t>(c.out, sum);
      break;
    }
    case kCheck: {
      std::vector<std::string> keys;
      if (!r.keys(keys)) return incomplete();
      const bool all = std::all_of(keys.begin(), keys.end(),
                                   [this](const std::string& k) { return values_.count(k) > 0; });
      append_value<std::uint8_t>(c.out, all ? kReady : kNotReady);
      break;
    }
    case kWait: {
      std::vector<std::string> keys;
      if (!r.keys(keys)) return incomplete();
      int missing = 0;
      for (const auto& key : keys) {
        if (values_.count(key) > 0) continue;
        waiting_[key].push_back(id);
        ++missing;
      }
      if (missing == 0) {
        append_value<std::uint8_t>(c.out, kStopWaiting);
      } else {
        c.awaited = missing;
      }
      break;
    }
    case kGetNumKeys: append_value<std::int64_t>(c.out, static_cast<std::int64_t>(values_.size())); break;
    case kDeleteKey: {
      std::string key;
      if (!r.bytes(key)) return incomplete();
      append_value<std::int64_t>(c.out, static_cast<std::int64_t>(values_.erase(key)));
      break;
    }
    case kWatchKey:
      warn("client " + peer_name(c.fd) + " asked to watch a key (TCPStore::watchKey), which "
           "fsdp-run's store does not serve; disconnecting it. Launch with torchrun to use it");
      return Parsed::Malformed;
    default:
      warn("client " + peer_name(c.fd) + " sent request type " + std::to_string(type) +
           ", which is not libtorch 1.13's TCPStore protocol; disconnecting it");
      return Parsed::Malformed;
  }
  end = r.pos();
  return Parsed::Done;
}

void AgentStore::set_value(const std::string& key, std::string value) {
  values_[key] = std::move(value);
  auto it = waiting_.find(key);
  if (it == waiting_.end()) return;
  for (std::uint64_t id : it->second) {
    auto c = clients_.find(id);
    if (c != clients_.end() && --c->second.awaited == 0) {
      append_value<std::uint8_t>(c->second.out, kStopWaiting);
    }
  }
  waiting_.erase(it);
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
  clients_.erase(it);
  for (auto w = waiting_.begin(); w != waiting_.end();) {
    auto& ids = w->second;
    ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
    w = ids.empty() ? waiting_.erase(w) : std::next(w);
  }
}

}  // namespace fsdp::launcher
