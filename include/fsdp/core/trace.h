#pragma once
/// Schedule trace of one FullyShardedDataParallel on one rank: every all-gather,
/// reduction, forward and backward span per unit, written as Chrome trace JSON
/// ("ph":"X" complete events; open in https://ui.perfetto.dev or chrome://tracing).
///
/// Enabled by Options::trace_dir or the environment variable FSDP_TRACE=<dir>
/// (read once, when the model is wrapped).
/// pid is the global rank; tid separates the streams: 0 compute (forward,
/// backward), 1 all-gather, 2 reduction. Timestamps are wall-clock microseconds,
/// so the files of all ranks line up when loaded together.
///
/// Every span also carries the *sequence numbers* of its begin and end events
/// (args.begin_seq / args.end_seq): one counter per rank, advanced at every begin
/// and end. Two events on one rank are ordered by them even when their
/// microsecond timestamps tie; tests check the schedule with them.
///
/// Collective spans (all-gather, reduce, replica all-reduce) also carry args.transport:
/// how the collective's bytes moved, as reported by the transport that took it ("shm":
/// shared-memory rings inside a host, "gloo": Gloo over TCP, "local": a group of one).
/// Under HYBRID_SHARD across hosts the shard group's spans say "shm" and the replica
/// all-reduce's "gloo".

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp {

struct TraceSpan {
  std::string name;    ///< "all_gather <unit>", "reduce <unit>", "forward <unit>", "backward <unit>"
  int tid = 0;         ///< 0 compute, 1 all-gather, 2 reduction
  int64_t begin_us = 0, end_us = 0;
  int64_t begin_seq = 0, end_seq = 0;
  std::string transport;  ///< collective spans: "shm", "gloo" or "local"; compute spans: ""
};

class Tracer {
 public:
  enum Stream { kCompute = 0, kGather = 1, kReduce = 2 };
  /// A span that has begun.
  struct Mark {
    int64_t us = -1, seq = -1;
    bool open() const { return seq >= 0; }
  };

  /// dir empty: disabled (every call is a no-op).
  Tracer(std::string dir, int rank);
  bool enabled() const { return !dir_.empty(); }
  Mark begin();
  /// Closes mark (no-op if not open). `transport`: see TraceSpan::transport.
  void end(const std::string& name, int tid, Mark& mark, const char* transport = "");
  std::vector<TraceSpan> spans() const;
  void clear();
  /// Writes <dir>/trace_rank<rank>.json (all spans so far). Returns the path, or "".
  std::string flush() const;

 private:
  std::string dir_;
  int rank_;
  mutable std::mutex mu_;
  int64_t seq_ = 0;
  std::vector<TraceSpan> spans_;
};

}  // namespace fsdp
