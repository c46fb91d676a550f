#pragma once
/// The words every part of fsdp::comm shares: how a reduction combines, which path a
/// collective's bytes took, which backend moves CUDA tensors, and the byte counters.
/// The bottom of the comm layer: it includes nothing of fsdp, so that the transports
/// (src/comm/shm, gloo, device) can speak these words without the collectives API above
/// them. collectives.h and process_group.h include it, so the public spelling
/// (fsdp::comm::ReduceOp, ...) is the same wherever it is included from.

#include <atomic>
#include <cstdint>

namespace fsdp::comm {

enum class ReduceOp {
  kSum,
  kAvg,
  kMax,  // all_reduce only
  Sum [[deprecated("use kSum")]] = kSum,
  Avg [[deprecated("use kAvg")]] = kAvg,
  Max [[deprecated("use kMax")]] = kMax,
};

/// How a collective's bytes moved. Set by the transport that took the call, so it names
/// the path really taken: a shared-memory group's broadcast, which goes through Gloo,
/// reports Gloo.
enum class CommPath {
  kLocal,         ///< a group of one rank: nothing moved
  kSharedMemory,  ///< the group's rings in /dev/shm (every rank on this host)
  kGloo,          ///< Gloo over TCP (loopback inside a host, the network across hosts)
  kNccl,          ///< NCCL (CUDA tensors)
  Local [[deprecated("use kLocal")]] = kLocal,
  SharedMemory [[deprecated("use kSharedMemory")]] = kSharedMemory,
  Gloo [[deprecated("use kGloo")]] = kGloo,
  Nccl [[deprecated("use kNccl")]] = kNccl,
};
/// "local", "shm", "gloo", "nccl" (the words the FSDP trace uses).
const char* to_string(CommPath path);

/// What moves CUDA tensors (CPU tensors always take shared memory or Gloo). NCCL needs one
/// GPU per rank; Gloo stages CUDA tensors through host memory and allows ranks to share a GPU;
/// Auto takes NCCL when every rank has a GPU of its own, Gloo when ranks share GPUs, and no
/// CUDA tensors at all when some rank has no GPU (or this build has no CUDA).
enum class Backend {
  kAuto,
  kGloo,
  kNccl,
  Auto [[deprecated("use kAuto")]] = kAuto,
  Gloo [[deprecated("use kGloo")]] = kGloo,
  NCCL [[deprecated("use kNccl")]] = kNccl,
};

/// Bytes sent per op, counted by whoever owns the counter (comm_counters() in
/// collectives.h: as the algorithm moves them).
struct CommCounters {
  std::atomic<int64_t> all_gather{0}, reduce_scatter{0}, all_reduce{0}, broadcast{0};
  int64_t total() const { return all_gather + reduce_scatter + all_reduce + broadcast; }
  void reset() { all_gather = 0; reduce_scatter = 0; all_reduce = 0; broadcast = 0; }
};

}  // namespace fsdp::comm
