// The setters of collectives.h and comm_testing.h over detail::comm_tuning() (see
// comm_tuning.h).
#include "comm_tuning.h"

#include <c10/util/Exception.h>

#include "comm_testing.h"
#include "fsdp/comm/collectives.h"

namespace fsdp::comm {

namespace detail {

CommTuning& comm_tuning() {
  static CommTuning tuning;
  return tuning;
}

}  // namespace detail

void set_comm_segment_bytes(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "fsdp: set_comm_segment_bytes: expected a positive byte count, got ",
              bytes);
  detail::comm_tuning().segment_bytes = bytes;
}

int64_t comm_segment_bytes() { return detail::comm_tuning().segment_bytes.load(); }

void set_comm_alltoall_max_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "fsdp: set_comm_alltoall_max_bytes: expected a byte count >= 0 "
              "(0 turns the alltoall path off), got ", bytes);
  detail::comm_tuning().alltoall_max_bytes = bytes;
}

int64_t comm_alltoall_max_bytes() { return detail::comm_tuning().alltoall_max_bytes.load(); }

void set_comm_shared_memory(bool on) { detail::comm_tuning().shared_memory = on; }

bool comm_shared_memory() { return detail::comm_tuning().shared_memory.load(); }

}  // namespace fsdp::comm
