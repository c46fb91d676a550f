#pragma once
/// Stateless collective helpers used by FSDP. Each returns a CommHandle whose
/// wait() completes the operation (including any local post-processing) within the
/// group's timeout, and raises c10::Error naming the op, group, rank and peer
/// hints on failure. Each takes the caller's label (call_label.h: phase and subject),
/// and all of them issue through one function ([Note: the collective choke point] in
/// src/comm/collective_call.h).
///
/// [Note: flat buffer and chunks]
///   A *flat buffer* of `numel = size * chunk` elements is cut into `size` equal,
///   contiguous *chunks*; chunk r belongs to rank r of the group. The caller pads the
///   buffer so that it divides (see padded_numel). All-gather fills the flat buffer
///   from every rank's chunk; reduce-scatter leaves in this rank's chunk output the
///   sum (or mean) of chunk r across ranks.
///
/// Each group moves data through a transport chosen when the group is created: shared
/// memory when all its ranks run on one host, Gloo otherwise (see [Note: transports] in
/// src/comm/transport.h). Gloo in libtorch 1.13 has no reduce_scatter and no
/// _allgather_base; both are built from Gloo send/recv, and for small buffers from Gloo's
/// alltoall (see [Note: point-to-point all-gather and reduce-scatter] in
/// src/comm/gloo/gloo_p2p.cpp).
/// Reduce-scatter sends chunk j to rank j ((N-1)/N of the buffer, the ring optimum) and
/// sums the N rows locally in rank order (over send/recv in segments, each as it
/// arrives), which makes the result deterministic and identical on every run and on
/// every transport (shared memory sums the same rows in the same order). All-gather sends the shard to every peer and, over send/recv, receives
/// straight into chunk views of the flat buffer (segmented too, no copy but this rank's
/// own chunk).
///
/// Memory over Gloo: reduce-scatter receives into a scratch buffer ((N-1)/N of the flat size over
/// send/recv, the flat size over alltoall), and the small-buffer all-gather sends from
/// one of the flat size. When such a buffer is 1 MiB or more the group keeps it between
/// calls (one idle buffer per group, the largest so far, freed with the group; see
/// comm_cached_bytes), because a fresh buffer that large page-faults in on every call
/// and slowed the transfer it overlaps. Over shared memory: each group maps one ring per
/// member (16 slots of 256 KiB by default, more above 9 ranks) for the group's lifetime,
/// and a reduce-scatter whose output lies inside its flat buffer reduces into a
/// temporary of the output's size (over send/recv too).
///
/// Ordering: like every collective, calls on one group must be issued in the same order
/// on every member (message tags are drawn from a per-group counter).

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

#include <torch/csrc/distributed/c10d/Work.hpp>  // CommHandle's destructor needs the whole type

#include "fsdp/comm/call_label.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/comm/types.h"

namespace fsdp::comm {

class CommHandle {
 public:
  CommHandle() = default;
  CommHandle(c10::intrusive_ptr<c10d::Work> work, ProcessGroup group, std::string op,
             std::function<void()> finish, CommPath path = CommPath::kLocal);
  /// Blocks until done (or throws after the group's timeout). Idempotent.
  void wait();
  bool defined() const { return work_ != nullptr || finish_ != nullptr; }
  /// Whether wait() would return without waiting on a peer, asked without blocking: true once
  /// waited, or when the backend's work has completed (Gloo). A transport that moves data
  /// only while someone waits (shared memory) answers false until wait() ran.
  bool is_completed() const;
  CommPath path() const { return path_; }
  /// CUDA tensors: makes the calling thread's current stream wait for the collective
  /// without blocking the host where the backend can (NCCL, whose work runs on a stream of
  /// its own); elsewhere nothing, since wait() orders the streams there. FSDP calls it with
  /// its all-gather or reduce-scatter stream current, right after the issue.
  void order_current_stream() const;
  /// Internal: the handle of a collective on CUDA tensors, which the group's device
  /// transport waits.
  CommHandle& on_device() {
    on_device_ = true;
    return *this;
  }
  /// Internal: the flight record (src/comm/flight_recorder.h) that wait() completes, or
  /// marks failed.
  void attach_record(const ProcessGroup& g, uint64_t seq) {
    record_group_ = g;
    record_seq_ = seq;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  ProcessGroup group_;
  std::string op_;
  std::function<void()> finish_;
  bool done_ = false;
  CommPath path_ = CommPath::kLocal;
  bool on_device_ = false;
  ProcessGroup record_group_;
  uint64_t record_seq_ = 0;
};

/// Smallest multiple of `size` that is >= numel.
int64_t padded_numel(int64_t numel, int64_t size);

/// flat[r*chunk:(r+1)*chunk] = shard of rank r. flat.numel() == size*shard.numel().
CommHandle all_gather_into(const ProcessGroup& g, const at::Tensor& flat, const at::Tensor& shard,
                           const CallLabel& label = {});
/// out = op over ranks of flat[rank*chunk:(rank+1)*chunk]. `flat` is left unspecified.
CommHandle reduce_scatter(const ProcessGroup& g, const at::Tensor& out, const at::Tensor& flat,
                          ReduceOp op = ReduceOp::kSum, const CallLabel& label = {});
/// Segment of all-gather and reduce-scatter: each chunk moves in messages of this many
/// bytes (rounded down to whole elements, at least one). Reduce-scatter sums one segment
/// while the next is in flight; on loopback TCP, 4 MiB messages also moved faster than
/// one message per chunk at 64 MiB (docs/benchmarks.md). Default 4 MiB. Process-wide; every rank of a group must use the same value
/// (it fixes the message sizes). Must be > 0.
void set_comm_segment_bytes(int64_t bytes);
int64_t comm_segment_bytes();
/// All-gather and reduce-scatter of flat buffers of at most this many bytes use Gloo's
/// alltoall through a scratch buffer of the flat size instead of send/recv, at N >= 3
/// (at N=2 it saved nothing): fewer wake-ups, markedly faster for small buffers when ranks share
/// cores. Same results and byte counts either way. Default 2 MiB; 0 turns it off.
/// Process-wide; every rank of a group must use the same value.
void set_comm_alltoall_max_bytes(int64_t bytes);
int64_t comm_alltoall_max_bytes();
/// Bytes of scratch buffers kept between calls by live groups (see "Memory" above).
int64_t comm_cached_bytes();

/// Memory for a buffer that collectives on `g` will read: on a shared-memory group, a
/// block of this process's exchange arena, which the peers have mapped, so an
/// all-gather (its output's own chunk), reduce-scatter or all-reduce on a flat buffer
/// there is read by the peers in place, one copy per byte instead of two ([Note:
/// exchange arena] in src/comm/shm/shm_arena.cpp). Otherwise (Gloo, one rank,
/// FSDP_SHM_DIRECT=0, the arena or /dev/shm full) ordinary CPU memory. Either way the
/// DataPtr frees it. Tensors elsewhere take the copying path, with the same results.
at::DataPtr allocate_collective_buffer(const ProcessGroup& g, size_t nbytes);
/// Live bytes of this process's exchange-arena blocks (what allocate_collective_buffer
/// handed out and is not yet freed; ordinary CPU memory it returned is the CPU
/// allocator's). Memory accounting that wraps the CPU allocator adds these through an
/// observer, called with +bytes when a block is handed out and -bytes when it is freed
/// (on the freeing thread). Observers are added once and stay for the process.
int64_t collective_buffer_bytes();
void add_collective_buffer_observer(void (*observer)(int64_t delta));
/// In place, every rank gets the reduction.
CommHandle all_reduce(const ProcessGroup& g, const at::Tensor& t, ReduceOp op = ReduceOp::kSum,
                      const CallLabel& label = {});
/// In place, from `root` (a rank of g).
CommHandle broadcast(const ProcessGroup& g, const at::Tensor& t, int root = 0, const CallLabel& label = {});
/// Blocks until every member arrives (or the timeout passes).
void barrier(const ProcessGroup& g, const CallLabel& label = {});

/// Bytes this process has sent through the helpers above, per op, since start or
/// the last reset (CommCounters in types.h). Counted as the algorithm moves them:
/// all-gather and reduce-scatter (N-1)/N of the flat buffer, ring all-reduce 2(N-1)/N of
/// it, broadcast the tensor (root) or nothing (others).
CommCounters& comm_counters();

}  // namespace fsdp::comm
