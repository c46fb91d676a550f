#pragma once
/// Sharded construction: models larger than one rank's memory.
///
///     auto pg = fsdp::comm::init_process_group();
///     auto options = fsdp::Options().auto_wrap_policy(fsdp::module_type_policy<BlockImpl>());
///     std::shared_ptr<GptImpl> gpt;
///     {
///       fsdp::ShardedInitContext sharded_init(pg, options);
///       torch::manual_seed(0);
///       gpt = std::make_shared<GptImpl>(cfg);   // each block sharded as it is built
///     }
///     auto model = fsdp::FullyShardedDataParallel(gpt, pg, options);  // adopts the shards
///
/// [Note: sharded construction]
/// libtorch 1.13 cannot build C++ modules on the meta device, but fsdp-cpp owns a
/// construction point: fsdp::Wrappable<Impl> ([Note: wrap candidates] in
/// wrappable.h). While a ShardedInitContext is alive on the thread, every Wrappable
/// runs, when its constructor returns, the same planning FullyShardedDataParallel
/// runs over the whole model (src/core/unit_plan.h) over its own subtree: the
/// units the wrap policy chooses there (the Wrappable itself, Sequential entries
/// inside it) are flattened into their padded flat buffers at once, this rank
/// keeps its shard, and the full values are freed. Every rank builds the same
/// model with the same random stream, so the values are those of eager
/// construction, bit for bit. A process therefore holds at most the shards built
/// so far, one Wrappable's full parameters plus its shard, and the parameters
/// outside units.
///
/// Until FullyShardedDataParallel adopts them, the sharded parameters are
/// placeholders: their full shapes, dtype and device stay queryable (a parent may
/// read `block->fc->weight.size(1)` or tie a parameter by reference), but any
/// operator that reads or writes them (a parent-level `apply(init)`, `mul_`,
/// printing) fails naming the parameter: initialise units with
/// Options::param_init_fn instead. `FullyShardedDataParallel(model, pg, options)`
/// built afterwards (inside the scope or after it) adopts the units without a
/// second copy; it refuses another process group or options that lay the shards
/// out differently, a policy that no longer chooses a unit sharded at
/// construction, and ties across units (naming both paths).
///
/// What the context cannot see:
///  * torch::nn::Sequential entries outside any Wrappable (fsdp-train's mlp and
///    cnn are Sequentials): they are not constructed through a Wrappable, so they
///    are sharded by FullyShardedDataParallel as usual. A context that ends having
///    sharded nothing warns.
///  * Module paths: a module's path exists only once its parent registers it,
///    after its constructor returned. Policies that need the path (path_policy)
///    are refused; a custom policy is called with the path relative to the
///    Wrappable being constructed ("" for itself), and FullyShardedDataParallel
///    checks that its own walk agrees.
///  * ignored_modules (the modules do not exist yet) are refused.

#include <cstdint>
#include <memory>

#include "fsdp/comm/process_group.h"
#include "fsdp/core/options.h"

namespace fsdp {

namespace core::detail {
class ShardedInitState;
}  // namespace core::detail

/// Scope object: while alive, Wrappables constructed on this thread are sharded
/// when their constructors return (see [Note: sharded construction]). One per
/// thread at a time. Collective only with Options::sync_module_states (each unit
/// is broadcast from rank 0 before it is sharded, so every rank must construct
/// the same model); otherwise purely local.
class ShardedInitContext {
 public:
  ShardedInitContext(comm::ProcessGroup pg, Options options);
  ~ShardedInitContext();
  ShardedInitContext(const ShardedInitContext&) = delete;
  ShardedInitContext& operator=(const ShardedInitContext&) = delete;

  /// Units sharded so far, and their parameters' elements (full sizes).
  int64_t units_sharded() const;
  int64_t numel_sharded() const;

 private:
  std::unique_ptr<core::detail::ShardedInitState> state_;
};

/// Whether `param` belongs to a unit sharded at construction and not yet adopted
/// by FullyShardedDataParallel (a placeholder: full shape, no values).
bool is_sharded_placeholder(const at::Tensor& param);

}  // namespace fsdp
