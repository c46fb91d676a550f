#pragma once
// What this rank holds of each original parameter of a FullyShardedDataParallel,
// in the terms checkpoints and state dicts use: the element range [begin, end)
// of the parameter's flattened value (see [Note: padded flat buffer]). The
// parameter's current data is exactly those elements (1-D under FULL_SHARD and
// SHARD_GRAD_OP, full shape under NO_SHARD and for ignored parameters).

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/dist/process_group.h"
#include "fsdp/fsdp/fully_sharded.h"

namespace fsdp::state {

struct LocalPiece {
  std::string name;            // fqn in the unwrapped model
  at::Tensor param;            // the registered parameter (identity is the optimizer's key)
  std::vector<int64_t> shape;  // original shape
  int64_t numel = 0;
  int64_t begin = 0, end = 0;  // this rank's elements of the flattened parameter
  bool replicated = false;     // every rank holds the same full value (NO_SHARD, ignored)
  bool writer = false;         // this rank saves it: one copy per element range (rank 0 for
                               // replicated values, the first replica under HYBRID_SHARD)
  int unit = -1;               // unit index, -1 for ignored parameters
  /// Other names of the same tensor (tied parameters: one tensor registered by
  /// two modules), in named_parameters() order. They share this piece's values.
  std::vector<std::string> aliases;
  /// param's data as a flat view of elements [begin, end).
  at::Tensor flat() const;
};

/// Every parameter once (tied aliases under their first name, the others in
/// `aliases`), in unit order,
/// then ignored parameters. Fails unless every unit is idle and sharded
/// (`what` names the caller in the message).
std::vector<LocalPiece> local_pieces(FullyShardedBase& model, const char* what);

}  // namespace fsdp::state
