#pragma once
// [Note: state-layer contract]
// The state layer (src/state: state dicts, SummonFullParams, optimizer state
// dicts, checkpoints) and apply_with_full_params see a FullyShardedDataParallel
// only through StateView:
//  * read-only facts: the units in order (index u = position, root first), each
//    unit's module path, whether it is sharded, its flat entries (original
//    parameters, their offsets and this rank's piece, see [Note: padded flat
//    buffer]), and the process groups;
//  * require_idle(what): the one check that the model is between training steps
//    (no backward running, every unit IDLE and sharded, which also excludes
//    being inside SummonFullParams or apply_with_full_params);
//  * local_pieces(what): what this rank holds of each original parameter;
//  * gather_full(u): a unit's full flat buffer in the shards' dtype;
//  * use_full_views / use_shard_views: point a unit's parameters at full-shape
//    views of such a buffer, and back at the shard (optionally writing back).
// state_view.cpp is the only file of the state layer that touches Unit or
// Runtime; the other files include no other header of src/core.

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flat_param.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/state_dict_type.h"

namespace fsdp::core::detail {

/// What this rank holds of one original parameter, in the terms checkpoints and
/// state dicts use: the element range [begin, end) of the parameter's flattened
/// value. The parameter's current data is exactly those elements (1-D under
/// FULL_SHARD and SHARD_GRAD_OP, full shape under NO_SHARD and for ignored
/// parameters).
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

class StateView {
 public:
  explicit StateView(FullyShardedBase& model);

  /// The model's process group (all ranks) and this rank in it.
  const comm::ProcessGroup& group() const;
  int rank() const;
  /// The group full flat buffers are gathered over: the shard group's ranks
  /// ([Note: hybrid groups]), on FSDP's own gather communicator.
  const comm::ProcessGroup& gather_group() const;
  torch::nn::Module& module() const;

  /// Fails unless the model is between training steps: not in backward, every
  /// unit IDLE with its parameters pointing at their shards (so also not inside
  /// SummonFullParams or apply_with_full_params). `what` names the caller.
  /// Not collective; every rank fails alike, before any collective.
  void require_idle(const char* what) const;

  /// Every parameter once (tied aliases under their first name, the others in
  /// `aliases`), in unit order, then ignored parameters. Calls require_idle(what).
  std::vector<LocalPiece> local_pieces(const char* what) const;

  size_t num_units() const;
  const std::string& unit_path(size_t u) const;  // "" for the root
  bool is_root(size_t u) const;
  /// Whether unit u is split across the gather group (false: NO_SHARD and
  /// full-precision BatchNorm units, whose shard is the whole flat buffer).
  bool sharded(size_t u) const;
  const std::vector<FlatParamEntry>& entries(size_t u) const;
  int64_t chunk_numel(size_t u) const;
  /// Elements of unit u's full flat buffer (real elements, then zero padding).
  int64_t padded_numel(size_t u) const;
  at::TensorOptions flat_options(size_t u) const;  // the shard's dtype (full precision)
  /// This rank's flat shard of unit u (padded; LOCAL state dicts read and write it).
  const at::Tensor& shard(size_t u) const;

  /// Unit u's full flat buffer in the shards' dtype: every rank's `chunk`
  /// (chunk_numel(u) elements) gathered over gather_group(). Collective over it
  /// for sharded units; returns `chunk` itself otherwise.
  at::Tensor gather_full(size_t u, const at::Tensor& chunk) const;
  /// gather_full(u, shard(u)): the unit's full parameter values.
  at::Tensor gather_full(size_t u) const;
  /// Full-shape view of entry i inside a full flat buffer of unit u.
  at::Tensor view_of(size_t u, const at::Tensor& full, size_t i) const;

  /// Points unit u's parameters at their full-shape views of `full` (from gather_full(u)).
  void use_full_views(size_t u, const at::Tensor& full);
  /// Points them back at their pieces of the shard, first copying this rank's
  /// chunk of `write_back` into the shard when given.
  void use_shard_views(size_t u, const at::Tensor* write_back);

  /// The model's schedule trace (its checkpoint track: Tracer::kCheckpoint), or null when
  /// tracing is off. Shared: an asynchronous save's writer may outlive the model.
  std::shared_ptr<Tracer> tracer() const;

  /// The state dict type selected on the model (StateDictTypeGuard).
  StateDictSelection& state_dict_selection();

 private:
  FullyShardedBase* model_;
  Runtime* runtime_;
};

}  // namespace fsdp::core::detail
