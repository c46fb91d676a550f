#pragma once
// Internal to src/comm: one shared-memory collective in flight on a channel (shm_channel.h):
// its plan, how far it got, and what it must keep alive until it completes.
//
// [Note: checked slots]
// Fragment numbers are never sent, so ranks that issue different collectives (another size,
// another op, one more or one fewer) would read each other's fragments as if they matched
// and complete with wrong data. Every fragment therefore carries its operation's number on
// the channel, kind and size in bytes, and a reader that finds other values than its own
// fails the operation naming both sides, before it uses the bytes.
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/comm/types.h"
#include "shm_ring_layout.h"

namespace fsdp::comm::detail {

/// ShmOp::kind, as slots carry it ([Note: checked slots]).
enum ShmOpKind : uint32_t { kShmAllGather = 1, kShmReduceScatter = 2, kShmAllReduce = 3 };

struct ShmOp {
  std::string name;
  uint64_t number = 0;   // 1, 2, ... in issue order on the channel
  uint32_t kind = 0;     // ShmOpKind
  int64_t bytes = 0;     // the flat buffer (all-gather, reduce-scatter) or the tensor
  std::vector<shm_plan::Stage> stages;
  size_t stage = 0;
  size_t writes_total = 0, writes_done = 0;
  at::ScalarType dtype = at::kFloat;
  ReduceOp reduce = ReduceOp::kSum;
  std::vector<at::Tensor> keep;    // what the fragments point into
  std::atomic<int64_t>* written = nullptr;   // this op's counter in shm_slot_counters()
  std::atomic<int64_t>* in_place = nullptr;  // and in shm_in_place_counters()
  bool done = false;
};

}  // namespace fsdp::comm::detail
