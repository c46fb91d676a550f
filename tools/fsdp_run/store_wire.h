#pragma once
/// The encoding of libtorch 2.x's TCPStore requests and replies, as the agent store reads and
/// writes them: request numbers, the handshake's magic number, reply codes, and a reader for
/// requests that may arrive in pieces. What each request means is [Note: agent store
/// protocol] in agent_store.h.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace fsdp::launcher::store_wire {

// c10d's QueryType, in its order (the wire carries the number). Later torch versions append to
// it and so far never renumber: a request a version lacks is simply never sent by its clients.
enum Request : std::uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kGetNumKeys = 7,
  kDeleteKey = 8,
  kAppend = 9,
  kMultiGet = 10,
  kMultiSet = 11,
  kCancelWait = 12,
  kPing = 13,
  kQueuePush = 14,
  kQueuePop = 15,
  kQueueLen = 16,
  kListKeys = 17,
  kBarrier = 18,
};

/// What a client sends with VALIDATE, its first request: the protocol's version mark.
constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;

constexpr std::uint8_t kReady = 0, kNotReady = 1;            // CHECK replies
constexpr std::uint8_t kStopWaiting = 0, kWaitCanceled = 1;  // WAIT, BARRIER, CANCEL_WAIT replies

// Bounds on what one request may announce, so a stray client (a port scan, another
// protocol) cannot make the launcher allocate without limit; real requests are far smaller.
constexpr std::uint64_t kMaxItemBytes = std::uint64_t{1} << 30;
constexpr std::uint64_t kMaxItemsPerRequest = std::uint64_t{1} << 20;

/// Reads the arguments of one request from a buffer that may not hold all of it yet. Every
/// getter returns false when the bytes are not there (yet); `malformed` says whether they
/// never will be (a length beyond the bounds above).
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
  /// A uint64 length and that many bytes (a key, a value).
  bool bytes(std::string& out) {
    std::uint64_t n = 0;
    if (!value(n)) return false;
    if (n > kMaxItemBytes) return refuse();
    if (buf_.size() - pos_ < n) return false;
    out.assign(buf_, pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return true;
  }
  /// A uint64 count of the items that follow (c10d sends MULTI_SET's as int64: same bytes).
  bool count(std::uint64_t& n) {
    if (!value(n)) return false;
    return n <= kMaxItemsPerRequest || refuse();
  }
  bool keys(std::vector<std::string>& out) {
    std::uint64_t n = 0;
    if (!count(n)) return false;
    out.resize(static_cast<std::size_t>(n));
    for (auto& key : out) {
      if (!bytes(key)) return false;
    }
    return true;
  }

 private:
  bool refuse() {
    malformed_ = true;
    return false;
  }

  const std::string& buf_;
  std::size_t pos_;
  bool malformed_ = false;
};

template <typename T>
void put_value(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

inline void put_bytes(std::string& out, const std::string& v) {
  put_value<std::uint64_t>(out, v.size());
  out += v;
}

}  // namespace fsdp::launcher::store_wire
