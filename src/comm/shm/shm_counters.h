#pragma once
// Internal to the library: what the shared-memory transport publishes, counted. For tests and
// benchmarks of the transports (comm_testing.h includes this); the channels add to them.
#include "fsdp/comm/types.h"

namespace fsdp::comm {

/// Bytes this process published to its peers through its shared-memory ring slots, per
/// op, counted where the fragment is published (each slot is then read by one peer, or by
/// every peer for all-gather data): copied into the slot, or published in place from the
/// exchange arena (see shm_in_place_counters). A measurement of the shared-memory
/// transport, to compare with comm_counters() volumes: all-gather publishes the shard once,
/// reduce-scatter (N-1)/N of the flat buffer, all-reduce the tensor once (its
/// reduce-scatter stage (N-1)/N, its all-gather stage this rank's chunk). `broadcast`
/// stays 0 (broadcast goes through Gloo).
CommCounters& shm_slot_counters();
/// The part of shm_slot_counters() published in place: peers read it from this rank's
/// exchange arena, and nothing was copied into a slot (see allocate_collective_buffer).
CommCounters& shm_in_place_counters();

}  // namespace fsdp::comm
