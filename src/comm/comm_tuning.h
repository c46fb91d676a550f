#pragma once
// Internal to src/comm: the per-call knobs of collectives.h (set_comm_segment_bytes,
// set_comm_alltoall_max_bytes) and comm_testing.h (set_comm_shared_memory). They are
// process-wide by their contract (benchmarks and tests flip them between calls, and every rank of a
// group must hold the same values when it issues a call), so they are kept here once
// and read by the transports when a call is issued, never cached in a group.
#include <atomic>
#include <cstdint>

namespace fsdp::comm::detail {

struct CommTuning {
  /// All-gather and reduce-scatter over send/recv move each chunk in messages of about
  /// this many bytes.
  std::atomic<int64_t> segment_bytes{int64_t(4) << 20};
  /// Flat buffers of at most this many bytes go through Gloo's alltoall at N >= 3.
  std::atomic<int64_t> alltoall_max_bytes{int64_t(2) << 20};
  /// Groups with a shared-memory transport use it (false: their Gloo transport).
  std::atomic<bool> shared_memory{true};
};

CommTuning& comm_tuning();

}  // namespace fsdp::comm::detail
