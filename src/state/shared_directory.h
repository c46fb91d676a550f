#pragma once
// Internal to src/state: is a checkpoint directory the same directory for every rank?
//
// [Note: checkpoint directories are shared]
// save_checkpoint has every rank write its own file into `<dir>.tmp`, which rank 0
// created; rank 0 alone writes the metadata and renames the directory into place, and
// every rank of load_checkpoint reads the metadata and the files it names. All of that
// assumes that `dir` names one directory for every rank: a file system that every node
// mounts at the same path (NFS, Lustre, a cloud file share), which ranks on one host
// always have. On a path local to each node the save would seem to succeed while the
// other nodes' files stay in a `<dir>.tmp` that only they see, and the metadata on node 0
// names files node 0 does not have: found out at load time, or never.
// So save_checkpoint checks first, before any tensor is written: rank 0 writes a probe
// file holding a token unique to this save into the directory it has just created, every
// rank reads it, and the store tells every rank which ranks could not; then every
// rank fails with the same message, naming those ranks and their hosts. A probe left in a
// node-local `<dir>.tmp` by an earlier attempt cannot pass (its token differs). A rank
// that does not see the probe at once looks again for up to kProbeWait: a shared file
// system may show another client's new file a moment late (NFS attribute caching).
// Cost per save: one small file written and read, a few bytes through the store ([Note:
// checkpoint agreement through the store] in store_agreement.h).

#include <chrono>
#include <string>

#include "store_agreement.h"

namespace fsdp::state {

constexpr std::chrono::milliseconds kProbeWait{3000};

/// Every rank of `agree`'s group calls it. `dir` is a directory rank 0 has just created. Returns "" when
/// every rank sees rank 0's probe file in `dir`, else the error every rank should raise
/// (the same on all ranks; it names `what` and `shown_dir`, the path the user gave).
/// The probe file is removed either way.
std::string check_shared_directory(const StoreAgreement& agree, const std::string& dir,
                                   const std::string& shown_dir, const char* what);

}  // namespace fsdp::state
