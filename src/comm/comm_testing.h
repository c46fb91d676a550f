#pragma once
// Internal to the library, for tests and benchmarks of the transports (they have src/
// on their include path): a process-wide switch that sends a shared-memory group's
// collectives over its Gloo transport, and counters of what the shared-memory
// transport publishes. Training code picks its transport per group with
// InitOptions::shared_memory (process_group.h) instead.
#include "fsdp/comm/collectives.h"

namespace fsdp::comm {

/// Whether groups that have a shared-memory channel use it (see [Note: shared-memory
/// transport] in src/comm/shm/shm_channel.cpp). Default true. For benchmarks and tests
/// that compare the two transports in one run: process-wide, read when a call is
/// issued, and every rank of a group must use the same value for each call. A
/// collective issued with it off reports CommPath::Gloo.
void set_comm_shared_memory(bool on);
bool comm_shared_memory();

/// Bytes this process published to its peers through its shared-memory ring slots, per
/// op, counted where the piece is published (each slot is then read by one peer, or by
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
