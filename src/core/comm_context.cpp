#include "comm_context.h"

#include <vector>

#include "cuda_streams.h"
#include "flat_param.h"
#include "stream_order_testing.h"

namespace fsdp::core::detail {

CommContext::CommContext(comm::ProcessGroup pg, const ResolvedOptions& options) : pg_(std::move(pg)) {
  build_hybrid_groups(options);
  build_dedicated_groups(options);
  set_up_stream_order(options);
}

void CommContext::build_hybrid_groups(const ResolvedOptions& options) {
  if (options.strategy != ShardingStrategy::kHybridShard) {
    shard_pg_ = pg_;
    return;
  }
  // shard_group_size divides the world size (resolve_options).
  shard_pg_ = pg_.split_consecutive(options.shard_group_size);
  replica_pg_ = pg_.split_strided(options.shard_group_size);
  TORCH_INTERNAL_ASSERT(shard_pg_.defined() && replica_pg_.defined());
}

void CommContext::build_dedicated_groups(const ResolvedOptions& options) {
  const int n = shard_pg_.size();
  // Dedicated groups over the shard group's ranks, so that gathers and
  // reductions form two independent sequences (see [Note: collective order]).
  // Created in the same order on every rank.
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r) all[r] = r;
  gather_pg_ = shard_pg_.new_subgroup(all);
  reduce_pg_ = options.reduce_group.defined() ? options.reduce_group : shard_pg_.new_subgroup(all);
  TORCH_INTERNAL_ASSERT(reduce_pg_.size() == n, "reduce group of ", reduce_pg_.size(), " ranks over a shard group of ",
                        n, " passed resolve_options");
}

void CommContext::set_up_stream_order(const ResolvedOptions& options) {
  // [Note: stream order wiring]: CUDA streams for a model on a GPU ([Note: device
  // placement]); the fake streams where a test switches them on (on the CPU only).
  const StreamOrderTestHooks& hooks = stream_order_test_hooks();
  if (options.device.is_cuda()) {
    streams_.set_backend(make_cuda_streams(options.device.index(), {hooks.delayed_stream, hooks.delay_cycles}));
    streams_.set_skipped_wait(hooks.skipped_wait);
    streams_.set_gather_handle_wait_off_compute(hooks.gather_handle_wait_off_compute);
    return;
  }
  if (!hooks.make_backend) return;
  streams_.set_backend(hooks.make_backend());
  streams_.set_skipped_wait(hooks.skipped_wait);
}

void CommContext::map_gathers(const std::string& path, FlatParameter& flat) {
  // [Note: zero-copy gathers]. Collective over the gather group: every rank adds the
  // same units in the same order.
  TORCH_CHECK(flat.options().device().is_cpu(), "fsdp (rank ", pg_.rank(), "): zero_copy_gather maps shards in host "
              "shared memory, but unit '", path, "' is on ", flat.options().device(), "; drop zero_copy_gather");
  std::string why;
  auto mapped = comm::MappedFlat::create(gather_pg_, flat.chunk_numel(), flat.shard().scalar_type(),
                                         {comm::Phase::kSetup, path}, &why);
  TORCH_CHECK(mapped, "fsdp (rank ", pg_.rank(), "): zero_copy_gather cannot map the shards of unit '", path,
              "': ", why, ". It needs every rank of the shard group on one host with shared memory on; drop "
              "zero_copy_gather");
  flat.map_unsharded(std::move(mapped));
  mapped_gathers_ = true;
}

}  // namespace fsdp::core::detail
