#pragma once
/// The agent store: with --max-restarts, node 0's fsdp-run serves the job's key-value store
/// itself, as torchrun's agent does, and every rank connects to it as a client
/// (TORCHELASTIC_USE_AGENT_STORE=True). The store then outlives each attempt: a restarted
/// rank 0 need not bind MASTER_PORT again while the old one's socket may linger, and the
/// ranks of attempt n keep to keys under "/worker/attempt_<n>" (the prefix the ranks add), so
/// they never read what an earlier attempt left.
///
/// [Note: agent store protocol] fsdp-run links no torch, so it speaks the wire protocol of
/// libtorch 1.13's c10d::TCPStore server itself (the client side is c10d's, in every rank).
/// A request is a one-byte type followed by its arguments; a "string" or "bytes" argument or
/// reply is a little-endian uint64 length and that many bytes:
///
///   0 SET         key, value                 -> (nothing)
///   1 COMPARE_SET key, expected, desired     -> bytes: the value now stored (see below)
///   2 GET         key                        -> bytes (clients WAIT for the key first)
///   3 ADD         key, int64 delta           -> int64: the new value (stored as decimal text)
///   4 CHECK       uint64 n, n keys           -> uint8: 0 all present, 1 not
///   5 WAIT        uint64 n, n keys           -> uint8 0 once every key is present
///   6 GETNUMKEYS                             -> int64
///   8 DELETE_KEY  key                        -> int64: keys deleted (0 or 1)
///
/// COMPARE_SET stores `desired` if the key is absent and `expected` is empty, or if the
/// stored value equals `expected`; either way it replies with the value stored afterwards
/// (an absent key with a non-empty `expected` replies `expected`, as c10d does). WATCH_KEY (7)
/// is not served: no rank of this project uses it; a client that asks is told so on
/// fsdp-run's stderr and disconnected. A malformed request closes its connection only.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace fsdp::launcher {

class AgentStore {
 public:
  /// Listens on `port` on every interface (0: a free port) and serves in a thread of its own
  /// until destroyed. Throws LauncherError if the port cannot be bound.
  static std::unique_ptr<AgentStore> start(int port);
  ~AgentStore();
  AgentStore(const AgentStore&) = delete;
  AgentStore& operator=(const AgentStore&) = delete;

  /// The port it listens on (MASTER_PORT of every rank).
  int port() const { return port_; }

 private:
  /// One client connection. `in` holds bytes not yet parsed into a whole request, `out`
  /// replies the socket did not take yet.
  struct Client {
    int fd = -1;
    std::string in;
    std::string out;
    /// WAIT: keys still missing; the reply goes out when this reaches 0.
    int awaited = 0;
  };
  enum class Parsed { Incomplete, Done, Malformed };

  AgentStore(int listen_fd, int port);
  void serve();
  void accept_clients();
  /// Parses and answers every whole request in `c.in`; false if the client must go.
  bool handle_input(std::uint64_t id, Client& c);
  /// The request at c.in[start..]: answered (Done, `end` just past it), not whole yet, or bad.
  Parsed handle_one(std::uint64_t id, Client& c, std::size_t start, std::size_t& end);
  void set_value(const std::string& key, std::string value);
  /// Sends what the socket takes of c.out; a dead client gets fd -1 (dropped by the caller).
  void flush(Client& c);
  void drop(std::uint64_t id);
  void warn(const std::string& line) const;

  int listen_fd_;
  int port_;
  int stop_pipe_[2] = {-1, -1};  // closing [1] wakes the thread to leave
  std::thread thread_;
  // Everything below belongs to the serving thread only.
  std::map<std::string, std::string> values_;
  std::map<std::uint64_t, Client> clients_;  // by id: fds are reused, ids never
  std::uint64_t next_id_ = 1;
  /// WAIT: for each missing key, the clients waiting for it.
  std::map<std::string, std::vector<std::uint64_t>> waiting_;
};

}  // namespace fsdp::launcher
