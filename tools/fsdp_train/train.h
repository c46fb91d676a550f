#pragma once
/// The training job of one rank: joins the process group, builds the model identically on
/// every rank, trains, evaluates, and (rank 0) reports. Collective: every rank runs it.

#include "options.h"

namespace fsdp::train {

/// Returns the process exit status (0 on success; 2 for a usage error found only once the
/// world size is known, reported by every rank).
int run_rank(const TrainOptions& options);

}  // namespace fsdp::train
