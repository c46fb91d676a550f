#pragma once
// Internal to src/comm: the checked mode (InitOptions::check_collectives,
// FSDP_CHECK_COLLECTIVES=1).
//
// [Note: checked collectives]
// Before the transport sees collective #s of a group, each rank publishes its record of it
// (op, dtype, size, label) under "fsdp/check/<group>/<s>/<rank>" in the job's store and reads
// every other rank's. Different records fail every rank at once with the divergence in words
// ([Note: first divergence] in divergence.h), before anything moves: a mismatch that Gloo
// would turn into an abort inside its own thread, or shared memory into an error, or a wait
// into a timeout, is named where it starts. A rank that does not publish within the group's
// timeout is named as not arriving; one known gone, at once. The store is a channel of its
// own, so the check does not depend on the transport it checks. A rank deletes its key of #s-2
// when it publishes #s: every rank had read it before publishing #s-1.
#include "flight_recorder.h"
#include "fsdp/comm/process_group.h"

namespace fsdp::comm::detail {

/// Compares `mine` (this rank's record of the collective about to be issued on `g`) with every
/// other rank's; throws naming the divergence, or the ranks that did not arrive.
void check_before_issue(const ProcessGroup& g, const CallRecord& mine);

}  // namespace fsdp::comm::detail
