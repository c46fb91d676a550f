#pragma once
// Internal to the library, for tests and benchmarks of the transports (they have src/
// on their include path): a process-wide switch that sends a shared-memory group's
// collectives over its Gloo transport, and counters of what the shared-memory
// transport publishes (shm/shm_counters.h). Training code picks its transport per group with
// InitOptions::shared_memory (process_group.h) instead.
#include "comm/shm/shm_counters.h"
#include "fsdp/comm/collectives.h"

namespace fsdp::comm {

/// Whether groups that have a shared-memory channel use it (see [Note: shared-memory
/// transport] in src/comm/shm/shm_channel.cpp). Default true. For benchmarks and tests
/// that compare the two transports in one run: process-wide, read when a call is
/// issued, and every rank of a group must use the same value for each call. A
/// collective issued with it off reports CommPath::kGloo.
void set_comm_shared_memory(bool on);
bool comm_shared_memory();

}  // namespace fsdp::comm
