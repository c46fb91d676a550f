#pragma once
// The communication context of one FullyShardedDataParallel root (FSDP2's
// FSDPCommContext): the process groups its collectives run on and the stream order they
// run in. Built once, before any unit, in the same order on every rank; the schedule
// (runtime.h) decides which collective comes next, this says where it goes.
//
// [Note: hybrid groups]
// HYBRID_SHARD shards over the *shard group* (shard_group_size consecutive
// ranks) and replicates across the *replica group* (the ranks holding the same
// shard index: i, i+g, ...). Both are built from the world group in the same
// order on every rank (consecutive blocks, then strided), before the dedicated
// gather/reduce groups, which then cover the shard group. For the other
// strategies the shard group is the world group and there is no replica group.

#include <string>

#include "fsdp/comm/process_group.h"
#include "resolved_options.h"
#include "stream_order.h"

namespace fsdp::core::detail {

class FlatParameter;

class CommContext {
 public:
  /// The groups over `pg` that `options` call for (strategy, shard_group_size,
  /// reduce_group) and the stream order of the model's device. Collective over `pg`.
  CommContext(comm::ProcessGroup pg, const ResolvedOptions& options);

  /// The group the wrapper was given.
  const comm::ProcessGroup& group() const { return pg_; }
  /// Dedicated groups over the shard group's ranks ([Note: collective order] in runtime.h).
  const comm::ProcessGroup& gather_group() const { return gather_pg_; }
  const comm::ProcessGroup& reduce_group() const { return reduce_pg_; }
  /// Parameters are sharded over this group (see [Note: hybrid groups]).
  const comm::ProcessGroup& shard_group() const { return shard_pg_; }
  /// HYBRID_SHARD: the ranks holding the same shard; undefined otherwise.
  const comm::ProcessGroup& replica_group() const { return replica_pg_; }

  /// [Note: stream order wiring] in runtime.h.
  StreamOrder& streams() { return streams_; }
  const StreamOrder& streams() const { return streams_; }

  /// Options::zero_copy_gather: `flat`'s unsharded buffer maps the gather group's shards.
  /// Collective over the gather group.
  void map_gathers(const std::string& path, FlatParameter& flat);
  /// Whether some unit gathers by mapping ([Note: zero-copy gathers] in flat_param.h).
  bool mapped_gathers() const { return mapped_gathers_; }

 private:
  void build_hybrid_groups(const ResolvedOptions& options);
  void build_dedicated_groups(const ResolvedOptions& options);
  void set_up_stream_order(const ResolvedOptions& options);

  // [Note: collective order] in runtime.h, [Note: hybrid groups].
  comm::ProcessGroup pg_, gather_pg_, reduce_pg_, shard_pg_, replica_pg_;
  StreamOrder streams_;  // off (no backend) unless a device or a test switches it on
  bool mapped_gathers_ = false;
};

}  // namespace fsdp::core::detail
