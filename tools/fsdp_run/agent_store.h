#pragma once
/// The agent store: with --max-restarts, node 0's fsdp-run serves the job's key-value store
/// itself, as torchrun's agent does, and every rank connects to it as a client
/// (TORCHELASTIC_USE_AGENT_STORE=True). The store then outlives each attempt: a restarted
/// rank 0 need not bind MASTER_PORT again while the old one's socket may linger, and the
/// ranks of attempt n keep to keys under "/worker/attempt_<n>" (the prefix the ranks add), so
/// they never read what an earlier attempt left.
///
/// [Note: agent store protocol] fsdp-run links no torch, so it speaks the wire protocol of
/// libtorch 2.x's c10d::TCPStore server itself (the client side is c10d's, in every rank);
/// verified against the clients of torch 2.11 and 2.15. A request is a one-byte type followed
/// by its arguments; a "bytes" argument or reply (a key, a value) is a little-endian uint64
/// length and that many bytes, numbers are little-endian. A connection opens with
///
///    0 VALIDATE    uint32 magic 0x3C85F7CE          -> (nothing)
///
/// and then sends any of (c10d clients send PING right after VALIDATE):
///
///    1 SET         key, value                       -> (nothing)
///    2 COMPARE_SET key, expected, desired           -> bytes: the value now stored (below)
///    3 GET         key                              -> bytes (clients WAIT for the key first)
///    4 ADD         key, int64 delta                 -> int64: the new value (stored as text)
///    5 CHECK       uint64 n, n keys                 -> uint8: 0 all present, 1 not
///    6 WAIT        uint64 n, n keys                 -> uint8 0 (STOP_WAITING) once all present
///    7 GETNUMKEYS                                   -> int64: keys (queues not counted)
///    8 DELETE_KEY  key                              -> int64: keys deleted (0 or 1)
///    9 APPEND      key, value                       -> (nothing); appends, or sets if absent
///   10 MULTI_GET   uint64 n, n keys                 -> n bytes (clients WAIT for them first)
///   11 MULTI_SET   uint64 n, n (key, value)         -> (nothing)
///   12 CANCEL_WAIT                                  -> uint8 1 (WAIT_CANCELED)
///   13 PING        uint32 nonce                     -> uint32: the nonce
///   14 QUEUE_PUSH  key, value                       -> (nothing)
///   15 QUEUE_POP   key                              -> int64 length; if > 0, bytes: the head
///   16 QUEUE_LEN   key                              -> int64
///   17 LIST_KEYS                                    -> int64 n, n bytes: every key
///   18 BARRIER     key, int64 world_size            -> uint8 0 once world_size have come
///
/// torch 2.11's clients send 0-17, 2.15's also BARRIER; the numbers are the same in both (c10d
/// appends to its list). libtorch 1.13 had no handshake, numbered SET..DELETE_KEY 0-8 with
/// WATCH_KEY at 7, and knew none of 9-18: a 1.x rank is refused at its first byte.
///
/// A WAIT whose keys are not all present is answered when the last one is set (SET, ADD,
/// APPEND, COMPARE_SET, MULTI_SET, the last BARRIER) or, for a queue's key, pushed to (which
/// releases one waiter). A client whose WAIT times out sends CANCEL_WAIT and reads until
/// WAIT_CANCELED, after a STOP_WAITING that crossed it if any. A key counts as present if
/// it has a value or names a non-empty queue; queues are apart from the values otherwise
/// (QUEUE_POP after a WAIT is a blocking pop). COMPARE_SET stores `desired` if the key is
/// absent and `expected` is empty, or if the stored value equals `expected`; either way it
/// replies with the value stored afterwards (an absent key with a non-empty `expected` replies
/// `expected`, as c10d does). BARRIER adds 1 to the key's count (as ADD) and is answered, with
/// every BARRIER waiting on that key, by the call that brings it to world_size.
///
/// Refusals: a connection whose first request is not VALIDATE with the magic above, or that
/// sends a request type not listed, is closed at once with one line on fsdp-run's stderr
/// naming the client (its c10d client fails at once instead of waiting out its timeout); so is
/// one announcing more than 1 GiB or 2^20 items, a GET of an absent key, or an ADD or BARRIER
/// on a value that is not a number. Other clients are not disturbed.

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "store_wire.h"

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
    std::string peer;  // "host:port", for messages (named at accept: it outlives the socket)
    std::string in;
    std::string out;
    /// Sent VALIDATE with the right magic; nothing else is read before.
    bool validated = false;
    /// WAIT: keys still missing; the reply goes out when this reaches 0.
    int awaited = 0;
  };
  enum class Parsed { Incomplete, Done, Refused };

  AgentStore(int listen_fd, int port);
  void serve();
  void accept_clients();
  /// Reads what the client sent; false if it hung up or its socket failed.
  bool receive(Client& c);
  /// Parses and answers every whole request in `c.in`; false if the client must go.
  bool handle_input(std::uint64_t id, Client& c);
  /// The request at c.in[start..]: answered (Done, `end` just past it), not whole yet, or
  /// refused (said on stderr; the client must go).
  Parsed handle_one(std::uint64_t id, Client& c, std::size_t start, std::size_t& end);
  Parsed handshake(Client& c, store_wire::Reader& r);
  Parsed answer(std::uint8_t type, std::uint64_t id, Client& c, store_wire::Reader& r);

  // One function per request type: read the arguments from `r`, act, queue the reply.
  Parsed on_compare_set(Client& c, store_wire::Reader& r);
  Parsed on_get(Client& c, store_wire::Reader& r, bool multi);
  Parsed on_add(Client& c, store_wire::Reader& r);
  Parsed on_wait(std::uint64_t id, Client& c, store_wire::Reader& r);
  Parsed on_multi_set(Client& c, store_wire::Reader& r);
  Parsed on_queue_pop(Client& c, store_wire::Reader& r);
  Parsed on_barrier(std::uint64_t id, Client& c, store_wire::Reader& r);
  Parsed on_cancel_wait(std::uint64_t id, Client& c);

  /// What an incomplete read means: more bytes to come, or a request that announced too much.
  Parsed shortfall(const Client& c, const store_wire::Reader& r) const;
  Parsed refuse(const Client& c, const std::string& why) const;
  /// The count stored at `key` (0 if absent) into `n`; false if the value is not a number.
  bool stored_count(const std::string& key, std::int64_t& n) const;
  /// Has a value, or names a queue with something in it.
  bool present(const std::string& key) const;
  void set_value(const std::string& key, std::string value);
  /// A key came to be present: every WAIT on it (all) or the first (a queue push) counts it.
  void release_waiters(const std::string& key, bool all);
  /// A WAIT on `id` that has no key left to wait for is answered.
  void count_released(std::uint64_t id);
  /// Forgets every WAIT and BARRIER of `id`.
  void forget_waits(std::uint64_t id);
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
  std::map<std::string, std::deque<std::string>> queues_;
  std::map<std::uint64_t, Client> clients_;  // by id: fds are reused, ids never
  std::uint64_t next_id_ = 1;
  /// WAIT: for each missing key, the clients waiting for it, first come first.
  std::map<std::string, std::vector<std::uint64_t>> waiting_;
  /// BARRIER: for each key, the clients that reached it and wait for the rest.
  std::map<std::string, std::vector<std::uint64_t>> barriers_;
};

}  // namespace fsdp::launcher
