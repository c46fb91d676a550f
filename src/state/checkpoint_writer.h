#pragma once
// Internal to src/state: writing a planned save ([Note: save plans] in save_plan.h), the
// same procedure for save_checkpoint and for save_checkpoint_async's writer thread. Phases:
// rank 0 makes `<dir>.tmp` and every rank sees it; every rank writes and fsyncs its file;
// rank 0 writes the metadata; the ranks agree through the store ([Note: checkpoint
// agreement through the store]), never a collective; then `<dir>.tmp` is renamed into place
// (docs/checkpoint-format.md, "Atomicity").

#include <cstdint>
#include <string>

#include "save_plan.h"
#include "store_agreement.h"

namespace fsdp::state {

enum class Publication {
  kNow,    // rank 0 renames the directory into place before the ranks agree it is done
  kLater,  // rank 0 leaves it complete in `<dir>.tmp`; publish() renames it later
};

struct WrittenSave {
  int64_t file_bytes = 0;    // this rank's file (0: it wrote none)
  int64_t direct_bytes = 0;  // of those, written straight from memory ([Note: direct writes])
};

/// Writes `plan` on every rank of `agree`'s group. Returns once this rank's file is durable
/// and rank 0 has written the metadata (and, with kNow, published); throws on every rank when
/// any failed, naming the rank and its error; nothing is renamed into place then.
WrittenSave write_checkpoint(const SavePlan& plan, const StoreAgreement& agree, Publication publication);

/// Rank 0: renames a complete `<dir>.tmp` into place, replacing `dir`.
void publish(const std::string& tmp, const std::string& dir);

}  // namespace fsdp::state
