#pragma once
/// Schedule trace of one FullyShardedDataParallel on one rank: every all-gather,
/// reduction, forward and backward span per unit, written as Chrome trace JSON
/// ("ph":"X" complete events; open in https://ui.perfetto.dev or chrome://tracing).
///
/// Enabled by Options::trace_dir or the environment variable FSDP_TRACE=<dir>
/// (read once, when the model is wrapped).
/// pid is the global rank; tid separates the streams: 0 compute (forward,
/// backward, the wait for offloaded steps), 1 all-gather, 2 reduction, 3 phases,
/// 4 checkpoint (a save's writing: "checkpoint write <dir>", on the writer thread of an
/// asynchronous save; its snapshot, "checkpoint snapshot <dir>", is a phase).
/// Timestamps are wall-clock microseconds, so the files of all ranks line up when
/// loaded together.
///
/// The phases (tid 3) are FSDP's own work on the thread that runs forward and backward,
/// between and around the compute spans: "issue_gather <unit>" and "wait_gather <unit>"
/// (an all-gather's issue and its wait: on one host the shared-memory transport moves
/// bytes inside both), "flatten <unit>" (copying a unit's gradients into its flat
/// gradient), "issue_reduce <unit(s)>", "wait_reduce <unit(s)>" (a reduction's issue and
/// the wait for it, the replica all-reduce's too) and "step <unit>" (the optimizer inside
/// backward: the step, or its hand-off to the offload host thread). A step's time outside
/// the compute spans is mostly these (bench/trace_breakdown.py sums them).
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
///
/// On a GPU, host times show when work was issued, and issues always overlap. A model on a
/// GPU also records device times: events on the span's stream when its work starts and ends
/// there (the compute stream for forward and backward, the all-gather and reduce-scatter
/// streams for the collectives; not the replica all-reduce). They appear as tids 10, 11 and 12
/// ("device: compute", ...) on the same clock, and in TraceSpan::device_begin_us/end_us.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp {

struct TraceSpan {
  /// "all_gather <unit>", "reduce <unit>", "forward <unit>", "backward <unit>"; "host_steps": the
  /// end of backward waiting for the host thread's optimizer steps (cpu_offload with
  /// optimizer_in_backward), while the device has no work.
  std::string name;
  int tid = 0;         ///< 0 compute, 1 all-gather, 2 reduction, 3 phases, 4 checkpoint
  int64_t begin_us = 0, end_us = 0;
  int64_t begin_seq = 0, end_seq = 0;
  std::string transport;  ///< collective spans: "shm", "gloo" or "local"; compute spans: ""
  /// When the span's work ran on its device stream (same clock as begin_us); -1 without one.
  int64_t device_begin_us = -1, device_end_us = -1;
};

/// Device times for the tracer (a model on a GPU; tests give a fake one).
class DeviceClock {
 public:
  virtual ~DeviceClock() = default;
  /// An event on stream `tid`'s device stream, behind the work issued to it so far.
  virtual std::shared_ptr<void> mark(int tid) = 0;
  /// When `event` happened, in wall-clock microseconds; waits for it.
  virtual int64_t time_us(const std::shared_ptr<void>& event) = 0;
};

class Tracer {
 public:
  enum Stream { kCompute = 0, kGather = 1, kReduce = 2, kPhase = 3, kCheckpoint = 4 };
  /// A span that has begun.
  struct Mark {
    int64_t us = -1, seq = -1;
    int device_tid = -1;                          ///< the stream of the device events
    std::shared_ptr<void> device_begin, device_end;
    bool open() const { return seq >= 0; }
  };

  /// dir empty: disabled (every call is a no-op).
  Tracer(std::string dir, int rank);
  bool enabled() const { return !dir_.empty(); }
  /// Device times from here on (null: none).
  void set_device_clock(std::shared_ptr<DeviceClock> clock);
  /// Opens a span; with a device clock and device_tid >= 0, also marks its start on that
  /// stream.
  Mark begin(int device_tid = -1);
  /// Marks the end of the span's device work now (a collective: right after its issue, before
  /// later work joins the stream). Without it, end() marks it.
  void end_on_device(Mark& mark);
  /// Closes mark (no-op if not open). `transport`: see TraceSpan::transport.
  void end(const std::string& name, int tid, Mark& mark, const char* transport = "");
  std::vector<TraceSpan> spans() const;
  void clear();
  /// Writes <dir>/trace_rank<rank>.json (all spans so far). Returns the path, or "".
  std::string flush() const;

 private:
  struct DeviceEvents {
    size_t span;
    std::shared_ptr<void> begin, end;
  };
  /// Reads the device events recorded so far into their spans (under mu_).
  void resolve_device_times() const;

  std::string dir_;
  int rank_;
  mutable std::mutex mu_;
  int64_t seq_ = 0;
  mutable std::vector<TraceSpan> spans_;
  std::shared_ptr<DeviceClock> clock_;
  mutable std::vector<DeviceEvents> pending_;
};

}  // namespace fsdp
