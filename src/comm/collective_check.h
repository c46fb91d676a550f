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
//
// [Note: waits across groups]
// Ranks that took different paths often wait on different groups: rank 1 in the check of
// the gathers' #7 (an extra forward), rank 0 in the check of the world's #2 (the loss it sums
// after its step). Neither check can see a difference on its own group, and each would wait
// for the timeout. So a rank that has waited kAnnounceWaitAfter publishes where it waits
// ("fsdp/check/waiting/<world rank>"), and reads where the ranks it waits for wait: when such
// a rank waits at #t of another group and this rank has not issued that group's #t (it cannot,
// blocked here), the two wait for each other, and once that has held for kWaitCycleHolds (a
// collective issued from another thread of this process would have ended it) both fail naming
// both sides. A rank withdraws its key when its wait ends with every rank arrived, and leaves
// it when its check fails, so that the peer waiting for it finds where it stopped. A key left
// from an earlier wait is harmless: that wait ended, so this rank had issued its #t.
#include "flight_recorder.h"
#include "fsdp/comm/process_group.h"

namespace fsdp::comm::detail {

/// Compares `mine` (this rank's record of the collective about to be issued on `g`) with every
/// other rank's; throws naming the divergence, or the ranks that did not arrive.
void check_before_issue(const ProcessGroup& g, const CallRecord& mine);

}  // namespace fsdp::comm::detail
