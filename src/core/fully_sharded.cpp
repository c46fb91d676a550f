#include "fsdp/core/fully_sharded.h"

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <torch/torch.h>

#include "comm/object_collectives.h"
#include "comm/device/placement.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/call.h"
#include "fsdp/core/host_memory.h"
#include "resolved_options.h"
#include "runtime.h"
#include "sequential_entry.h"
#include "unit_plan.h"
#include "sharded_init_state.h"

namespace fsdp {

using core::detail::FlatParamEntry;
using core::detail::FlatParameter;
using core::detail::IgnoredModules;
using core::detail::PlannedUnit;
using core::detail::Runtime;
using core::detail::SequentialEntryImpl;
using core::detail::SequentialSlot;
using core::detail::Unit;

namespace {

// Parameters by their TensorImpl.
using TensorSet = std::set<const c10::TensorImpl*>;

// The device's type, not its index: ranks sharing a host hold the model on GPUs of their own.
std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type() << " " << t.device().type() << (t.requires_grad() ? "" : " frozen");
  return os.str();
}

std::vector<std::pair<std::string, at::Tensor>> named_tensors(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : model.named_parameters()) out.emplace_back("'" + p.key() + "'", p.value());
  return out;
}

// Every rank compares its parameter list with rank 0's; on a difference every
// rank raises the same error naming the first difference (never a hang).
void check_same_model_on_all_ranks(const comm::ProcessGroup& pg, torch::nn::Module& model) {
  std::vector<std::string> lines;
  for (const auto& p : model.named_parameters()) lines.push_back(p.key() + " " + describe(p.value()));
  comm::detail::check_same_on_all_ranks(
      pg, lines, {"fsdp", "the model differs", "parameter", "Build the same model on every rank before wrapping"});
}

// Unsupported mixed-precision combinations fail here, before any group exists.
void check_mixed_precision(const MixedPrecision& mp, torch::nn::Module& model, int rank) {
  auto check_float = [&](const std::optional<at::ScalarType>& t, const char* what) {
    TORCH_CHECK(!t || at::isFloatingType(*t), "fsdp (rank ", rank, "): MixedPrecision ", what,
                " must be a floating-point dtype, got ", *t);
  };
  check_float(mp.param_dtype(), "param_dtype");
  check_float(mp.reduce_dtype(), "reduce_dtype");
  check_float(mp.buffer_dtype(), "buffer_dtype");
  if (!mp.param_dtype()) return;
  for (const auto& p : model.named_parameters()) {
    TORCH_CHECK(at::isFloatingType(p.value().scalar_type()), "fsdp (rank ", rank,
                "): mixed precision needs floating-point parameters; '", p.key(), "' is ",
                p.value().scalar_type());
  }
}

// Steps 1-4 (ignored modules, wrap policy, BatchNorm units, parameter
// assignment) are in unit_plan.h, shared with ShardedInitContext.

// Step 5: the unit's flat buffer over the shard group ([Note: hybrid groups];
// a HYBRID_SHARD group of one rank shards nothing and behaves as NO_SHARD).
Unit* create_unit(Runtime& runtime, const core::detail::ResolvedOptions& resolved, PlannedUnit& p) {
  core::detail::check_one_dtype_and_device(p);
  const auto strategy = resolved.strategy;
  const comm::ProcessGroup& shard_group = runtime.comm_context().shard_group();
  const bool sharded = strategy != ShardingStrategy::kNoShard &&
                       !(strategy == ShardingStrategy::kHybridShard && shard_group.size() == 1);
  const bool full_precision_unit = p.kind == PlannedUnit::Kind::kBatchNorm;
  const core::detail::FlatPrecision precision =
      core::detail::unit_precision(resolved.mixed_precision, p.entries.front().param.scalar_type(), full_precision_unit);
  auto flat = std::make_unique<FlatParameter>(std::move(p.entries), shard_group.rank(), shard_group.size(),
                                              sharded && !full_precision_unit, precision, resolved.cpu_offload);
  return runtime.add_unit(p.path, std::move(flat), p.kind == PlannedUnit::Kind::kRoot,
                          resolved.reshard_after_forward && !full_precision_unit);
}

// Step 5 for a unit whose parameters are partly frozen: the frozen ones go to a companion
// unit of their own at the same call site ([Note: frozen companions] in runtime.h).
// Returns the trainable unit.
Unit* create_split_unit(Runtime& runtime, const core::detail::ResolvedOptions& resolved, PlannedUnit& p) {
  size_t n_trainable = 0;
  for (const auto& e : p.entries) n_trainable += e.param.requires_grad() ? 1 : 0;
  const bool mixed = n_trainable > 0 && n_trainable < p.entries.size();
  if (!mixed || p.kind == PlannedUnit::Kind::kBatchNorm) return create_unit(runtime, resolved, p);
  std::vector<core::detail::FlatParamEntry> trainable, frozen;  // each in the unit's order
  for (auto& e : p.entries) (e.param.requires_grad() ? trainable : frozen).push_back(std::move(e));
  PlannedUnit companion;
  companion.kind = PlannedUnit::Kind::kCallSite;  // not a root: its hooks come through the unit's
  companion.path = p.path + " (frozen)";
  companion.entries = std::move(frozen);
  p.entries = std::move(trainable);
  Unit* unit = create_unit(runtime, resolved, p);
  runtime.set_companion(unit, create_unit(runtime, resolved, companion));
  return unit;
}

// Step 5, for a unit a ShardedInitContext sharded at construction ([Note: sharded
// construction] in sharded_init.h): its flat parameter is taken over as it is (no
// second copy), after checking that it holds exactly the parameters this
// wrapper's plan gives the unit, and renamed with their paths in the model.
void check_adoptable(const PlannedUnit& p, const core::detail::ConstructionUnit& cu) {
  const auto& have = cu.flat->entries();
  bool same = have.size() == p.entries.size();
  for (size_t i = 0; same && i < have.size(); ++i) same = have[i].param.is_same(p.entries[i].param);
  if (same) return;
  std::ostringstream now, then;
  for (const auto& e : p.entries) now << " '" << e.fqn << "'";
  for (const auto& e : have) then << " '" << e.fqn << "'";
  TORCH_CHECK(false, "fsdp: unit '", p.path, "' was sharded at construction by a ShardedInitContext with the "
              "parameters (relative to it)", then.str(), ", but in the model it now holds", now.str(),
              ". Parameters were added, removed or re-registered after its constructor returned; do that "
              "inside the module's constructor");
}

Unit* adopt_unit(Runtime& runtime, const core::detail::ResolvedOptions& resolved, PlannedUnit& p,
                 core::detail::ConstructionUnit& cu) {
  auto flat = core::detail::adopt_construction_unit(cu);
  for (size_t i = 0; i < p.entries.size(); ++i) {
    flat->entries()[i].fqn = p.entries[i].fqn;
    flat->entries()[i].module_path = p.entries[i].module_path;
  }
  return runtime.add_unit(p.path, std::move(flat), /*is_root=*/false, resolved.reshard_after_forward);
}

// Units sharded at construction (ShardedInitContext) are adopted: the policy must choose
// each of them again, with the same parameters. Returns, for each planned unit, the
// construction unit it takes over (null: none).
std::vector<core::detail::ConstructionUnit*> match_construction_units(torch::nn::Module& model, int rank,
                                                                const std::vector<PlannedUnit>& planned) {
  auto construction = core::detail::find_construction_units(model);
  std::vector<core::detail::ConstructionUnit*> adopt(planned.size(), nullptr);
  for (size_t i = 0; i < planned.size(); ++i) {
    if (planned[i].kind != PlannedUnit::Kind::kCallSite) continue;
    auto it = construction.find(planned[i].identity);
    if (it == construction.end()) continue;
    adopt[i] = it->second;
    construction.erase(it);
  }
  // A unit left over means another policy; say so before comparing parameters
  // (a policy change also moves parameters between units).
  if (!construction.empty()) {
    std::map<const torch::nn::Module*, std::string> path_of;
    for (const auto& item : model.named_modules()) path_of[item.value().get()] = item.key();
    const std::string path = path_of[construction.begin()->first];
    TORCH_CHECK(false, "fsdp (rank ", rank, "): module '", path, "' was sharded at construction by a "
                "ShardedInitContext, but this FullyShardedDataParallel's wrap policy (or ignored_modules) does not make "
                "it a unit (", construction.size(), " such unit(s)). Pass FullyShardedDataParallel the options the "
                "ShardedInitContext was given; a custom policy must not depend on the module path");
  }
  for (size_t i = 0; i < planned.size(); ++i)
    if (adopt[i]) check_adoptable(planned[i], *adopt[i]);
  return adopt;
}

// Step 6: the candidate's call site invokes the unit's hooks ([Note: wrap
// candidates]); both patches are undone by ~FullyShardedBase.
void patch_call_site(const PlannedUnit& p, UnitHooks* hooks, std::vector<std::unique_ptr<SequentialSlot>>& slots,
                     std::vector<WrappableBase*>& wrappables, std::vector<const torch::nn::Module*>& entries) {
  if (p.list_entry) {
    core::detail::set_entry_hooks(p.module.get(), hooks);
    entries.push_back(p.module.get());
  } else if (p.sequential) {
    auto slot = std::make_unique<SequentialSlot>();
    slot->sequential = p.sequential;
    slot->index = p.index;
    auto it = p.sequential->begin() + p.index;
    slot->original = *it;
    *it = torch::nn::AnyModule(std::make_shared<SequentialEntryImpl>(slot->original, hooks));
    slots.push_back(std::move(slot));
  } else {
    auto* w = dynamic_cast<WrappableBase*>(p.module.get());
    TORCH_INTERNAL_ASSERT(w != nullptr);
    w->set_fsdp_unit_hooks(hooks);
    wrappables.push_back(w);
  }
}

// The constructor's phases, in the order it runs them.

// Wrapping twice would stack hooks on the same call sites.
void check_not_wrapped(const std::shared_ptr<torch::nn::Module>& model) {
  for (const auto& m : model->modules()) {
    auto* w = dynamic_cast<WrappableBase*>(m.get());
    TORCH_CHECK(w == nullptr || w->fsdp_unit_hooks() == nullptr, "fsdp: module '", m->name(),
                "' is already part of a FullyShardedDataParallel; wrap a model once, at its root");
    if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(m.get())) {
      for (const auto& entry : *seq)
        TORCH_CHECK(!entry.ptr() || !std::dynamic_pointer_cast<SequentialEntryImpl>(entry.ptr()),
                    "fsdp: this model is already wrapped by FullyShardedDataParallel; wrap it once");
    }
  }
  TORCH_CHECK(!std::dynamic_pointer_cast<FullyShardedBase>(model),
              "fsdp: the module is already a FullyShardedDataParallel; wrap the model once");
}

// Units a ShardedInitContext sharded at construction are adopted as they are, so they
// must have been laid out for this group and these options. Returns their parameters.
TensorSet check_construction_units(torch::nn::Module& model, const comm::ProcessGroup& pg,
                                   const core::detail::ResolvedOptions& resolved) {
  TensorSet sharded_at_construction;
  const auto construction = core::detail::find_construction_units(model);
  std::map<const torch::nn::Module*, std::string> path_of;
  if (!construction.empty())
    for (const auto& item : model.named_modules()) path_of[item.value().get()] = item.key();
  for (const auto& [module, cu] : construction) {
    TORCH_CHECK(!resolved.cpu_offload, "fsdp (rank ", pg.rank(), "): unit '", path_of[module],
                "' was sharded at construction by a ShardedInitContext, whose shards live on the model's "
                "device; Options::cpu_offload cannot take them over. Construct the model without a "
                "ShardedInitContext to offload it");
    const auto expected = core::detail::sharding_signature(pg, resolved, cu->flat->shard().scalar_type());
    TORCH_CHECK(core::detail::same_sharding(cu->signature, expected), "fsdp (rank ", pg.rank(), "): unit '",
                path_of[module], "' was sharded at construction by a ShardedInitContext for ",
                core::detail::describe(cu->signature), ", but this FullyShardedDataParallel would lay it out for ",
                core::detail::describe(expected), ". Pass FullyShardedDataParallel the process group and options "
                "the ShardedInitContext was given");
    for (const auto& e : cu->flat->entries()) sharded_at_construction.insert(e.param.unsafeGetTensorImpl());
  }
  return sharded_at_construction;
}

// Options::param_init_fn on every module whose parameters are still here (units sharded
// at construction ran it there), before they are broadcast and sharded.
void run_param_init(const Options& options, torch::nn::Module& model, const TensorSet& sharded_at_construction) {
  const auto& init = options.param_init_fn();
  if (!init) return;
  torch::NoGradGuard no_grad;
  for (const auto& m : model.modules()) {
    bool own = false, sharded = false;
    for (const auto& p : m->parameters(false)) {
      own = true;
      sharded = sharded || sharded_at_construction.count(p.unsafeGetTensorImpl());
    }
    if (own && !sharded) init(*m);
  }
}

// Rank 0's parameters and buffers on every rank; units sharded at construction were
// broadcast there, unit by unit.
void broadcast_module_states(const comm::ProcessGroup& pg, torch::nn::Module& model,
                             const TensorSet& sharded_at_construction) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters())
    if (!sharded_at_construction.count(p.unsafeGetTensorImpl())) comm::broadcast(pg, p.detach(), 0).wait();
  for (auto& b : model.buffers()) comm::broadcast(pg, b, 0).wait();
}

// The model's initial values, then the collective checks that every rank wraps the same
// model the same way.
void init_and_sync(torch::nn::Module& model, const comm::ProcessGroup& pg, const Options& options,
                   const core::detail::ResolvedOptions& resolved, const TensorSet& sharded_at_construction) {
  run_param_init(options, model, sharded_at_construction);
  if (options.sync_module_states()) broadcast_module_states(pg, model, sharded_at_construction);
  check_same_model_on_all_ranks(pg, model);
  // Offload changes no collective's size, so ranks that disagree would train without a
  // hang, with shards in different memories: refused like a different model.
  comm::detail::check_same_on_all_ranks(
      pg, {std::string("cpu_offload(") + (resolved.cpu_offload ? "true" : "false") + ")"},
      {"fsdp", "the placement differs", "option", "Pass the same Options::cpu_offload on every rank"});
}

// Checks the mixed-precision options against the model and converts its buffers once;
// returns the dtype the root casts its forward inputs to, if any.
std::optional<at::ScalarType> apply_mixed_precision(const MixedPrecision& mp, torch::nn::Module& model, int rank) {
  check_mixed_precision(mp, model, rank);
  std::optional<at::ScalarType> root_input_dtype;
  if (mp.param_dtype() && mp.cast_forward_inputs()) root_input_dtype = mp.param_dtype();
  if (mp.buffer_dtype()) {
    // BatchNorm statistics stay in full precision when BatchNorm layers get their own
    // full-precision units.
    torch::NoGradGuard no_grad;
    const bool keep_bn = mp.param_dtype() && mp.full_precision_batch_norm();
    for (const auto& m : model.modules()) {
      if (keep_bn && core::detail::is_batch_norm(*m)) continue;
      for (auto& b : m->buffers(false))
        if (b.is_floating_point()) b.set_data(b.to(*mp.buffer_dtype()));
    }
  }
  return root_input_dtype;
}

}  // namespace

FullyShardedBase::FullyShardedBase(std::shared_ptr<torch::nn::Module> model, comm::ProcessGroup pg,
                                   Options options)
    : torch::nn::Module("FullyShardedDataParallel"), model_(std::move(model)), pg_(std::move(pg)),
      options_(std::move(options)) {
  TORCH_CHECK(model_ != nullptr, "fsdp: FullyShardedDataParallel got an empty module holder");
  TORCH_CHECK(pg_.defined(), "fsdp: FullyShardedDataParallel needs a process group; call "
              "fsdp::comm::init_process_group() first");
  comm::LabelScope label({comm::Phase::kSetup, "FullyShardedDataParallel"});
  const core::detail::ResolvedOptions resolved = validate();
  const TensorSet sharded_at_construction = check_construction_units(*model_, pg_, resolved);
  init_and_sync(*model_, pg_, options_, resolved, sharded_at_construction);
  root_input_dtype_ = apply_mixed_precision(options_.mixed_precision(), *model_, pg_.rank());
  register_children();
  build_units(resolved);
}

// The options resolved and the model checked before the first collective: a rank with a
// bad option must fail alone and at once, not leave its peers waiting in one. The device
// is the one the model is on, checked against the group ([Note: device placement]).
core::detail::ResolvedOptions FullyShardedBase::validate() const {
  core::detail::ResolvedOptions resolved = core::detail::resolve_options(options_, pg_);
  check_not_wrapped(model_);
  resolved.device = comm::detail::model_device(named_tensors(*model_), pg_, "fsdp");
  return resolved;
}

// The wrapper shows the model's own children, parameters and buffers under their own
// names (same TensorImpls), so named_parameters() is unchanged.
void FullyShardedBase::register_children() {
  for (const auto& c : model_->named_children()) register_module(c.key(), c.value());
  for (const auto& p : model_->named_parameters(false))
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  for (const auto& b : model_->named_buffers(false)) register_buffer(b.key(), b.value());
}

void FullyShardedBase::train(bool on) {
  torch::nn::Module::train(on);
  model_->train(on);
}

FullyShardedBase::~FullyShardedBase() {
  // Put the user's Sequential entries and Wrappable marks back as they were.
  for (auto& slot : sequential_slots_) *(slot->sequential->begin() + slot->index) = slot->original;
  for (auto* w : wrappables_) w->set_fsdp_unit_hooks(nullptr);
  for (const auto* e : called_entries_) core::detail::set_entry_hooks(e, nullptr);
}

void FullyShardedBase::build_units(const core::detail::ResolvedOptions& resolved) {
  const IgnoredModules ignored(*model_, options_.ignored_modules());
  std::vector<PlannedUnit> planned = core::detail::walk_wrap_policy(*model_, options_.auto_wrap_policy(), ignored);
  const auto& mp = options_.mixed_precision();
  if (mp.param_dtype() && mp.full_precision_batch_norm()) core::detail::add_batch_norm_units(*model_, ignored, planned);
  core::detail::assign_parameters(*model_, ignored, planned);
  const std::vector<core::detail::ConstructionUnit*> adopt = match_construction_units(*model_, pg_.rank(), planned);

  // The runtime (and its dedicated process groups) is created only now, after
  // every local check above: a user error that every rank raises (tied
  // parameters across units) must not leave freshly created groups that the
  // ranks tear down while peers are still connecting.
  runtime_ = std::make_unique<Runtime>(pg_, resolved);
  if (resolved.keep_freed_host_memory) keep_freed_host_memory();
  const core::detail::ShardLayout layout = core::detail::shard_layout(resolved, pg_);
  const comm::ProcessGroup& shard_group = runtime_->comm_context().shard_group();
  TORCH_INTERNAL_ASSERT(layout.rank == shard_group.rank() && layout.world == shard_group.size(),
                        "shard_layout disagrees with the runtime's shard group");
  for (size_t i = 0; i < planned.size(); ++i) {
    PlannedUnit& p = planned[i];
    if (p.entries.empty()) continue;  // nothing to shard: no unit, no hooks
    Unit* unit = adopt[i] ? adopt_unit(*runtime_, resolved, p, *adopt[i]) : create_split_unit(*runtime_, resolved, p);
    switch (p.kind) {
      case PlannedUnit::Kind::kRoot: root_unit_ = unit; break;
      case PlannedUnit::Kind::kBatchNorm: runtime_->add_implicit_unit(unit); break;
      case PlannedUnit::Kind::kCallSite:
        patch_call_site(p, runtime_->call_site(unit), sequential_slots_, wrappables_, called_entries_);
        if (p.list_entry) runtime_->add_entry_unit(unit);
        break;
    }
  }
}

std::vector<std::string> FullyShardedBase::unit_paths() const {
  std::vector<std::string> out;
  for (const auto& u : runtime_->units()) out.push_back(u->path());
  return out;
}

std::vector<std::string> FullyShardedBase::unit_parameter_names(size_t i) const {
  TORCH_CHECK(i < runtime_->units().size(), "fsdp: unit index ", i, " out of range");
  std::vector<std::string> out;
  for (const auto& e : runtime_->units()[i]->flat().entries()) out.push_back(e.fqn);
  return out;
}

MemoryStats FullyShardedBase::memory_stats() const { return runtime_->memory_stats(); }
void FullyShardedBase::set_unit_boundary_observer(
    std::function<void(const std::string& unit, const char* phase)> observer) {
  runtime_->set_boundary_observer(std::move(observer));
}
void FullyShardedBase::reset_peak_memory_stats() { runtime_->reset_peak(); }
void FullyShardedBase::empty_cache() { runtime_->pool().release_idle(); }

std::vector<std::string> FullyShardedBase::units_placed_on_device() const {
  std::vector<std::string> paths;
  for (const core::detail::Unit* u : runtime_->step_policy().placed_on_device()) paths.push_back(u->path());
  return paths;
}

std::vector<TraceSpan> FullyShardedBase::trace_spans() const { return runtime_->tracer().spans(); }
std::string FullyShardedBase::flush_trace() { return runtime_->tracer().flush(); }
void FullyShardedBase::clear_trace() { runtime_->tracer().clear(); }

void FullyShardedBase::root_pre_forward() { runtime_->root_pre_forward(root_unit_); }

void FullyShardedBase::root_post_forward(const std::vector<at::Tensor>& outputs) {
  runtime_->root_post_forward(root_unit_, outputs);
}

void FullyShardedBase::rethrow_forward_failure(const std::exception& e) const {
  // A ModuleList entry called directly meets its parameters as 1-D shards: when no entry
  // unit went through fsdp::call before the failure, that is the likely cause.
  const size_t entries = runtime_->entry_unit_count();
  const bool none_called = entries > 0 && runtime_->uncalled_entries().size() == entries;
  if (!none_called) throw;
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  TORCH_CHECK(false, c10_error ? c10_error->what_without_backtrace() : e.what(), "\n(This forward called none of ",
              "the ModuleList or ModuleDict entries that are units through fsdp::call. If it calls them ",
              "directly, their parameters are this rank's flat shards there: ", core::detail::Runtime::kEntryCallFix,
              ".)");
}

at::Tensor FullyShardedBase::clip_grad_norm_(double max_norm, double norm_type) {
  TORCH_CHECK(!runtime_->step_policy().optimizer_in_backward(), "fsdp (rank ", pg_.rank(), "): clip_grad_norm_ "
              "needs every gradient before any parameter is stepped, but Options::optimizer_in_backward steps each "
              "unit during backward and frees its gradients. Turn optimizer_in_backward off to clip the global norm");
  TORCH_CHECK(max_norm >= 0, "fsdp: clip_grad_norm_ max_norm must be >= 0, got ", max_norm);
  TORCH_CHECK(norm_type > 0, "fsdp: clip_grad_norm_ norm_type must be > 0 or inf, got ", norm_type);
  const bool inf = std::isinf(norm_type);
  std::vector<at::Tensor> sharded_grads, replicated_grads;
  std::set<const c10::TensorImpl*> managed;
  bool reduce = false;
  for (const auto& u : runtime_->units()) {
    // Replicated units (NO_SHARD, full-precision BatchNorm units) count once.
    reduce = reduce || u->flat().sharded();
    for (const auto& e : u->flat().entries()) {
      managed.insert(e.param.unsafeGetTensorImpl());
      if (e.param.grad().defined())
        (u->flat().sharded() ? sharded_grads : replicated_grads).push_back(e.param.grad());
    }
  }
  // Ignored parameters are replicated: counted once, after the reduction.
  for (const auto& p : model_->parameters())
    if (!managed.count(p.unsafeGetTensorImpl()) && p.grad().defined()) replicated_grads.push_back(p.grad());
  // Shards are disjoint inside the shard group and identical across replicas
  // ([Note: hybrid groups]), so the norm is reduced over the shard group only.
  const comm::ProcessGroup& norm_group = runtime_->comm_context().shard_group();
  reduce = reduce && norm_group.size() > 1;

  auto local = [&](const std::vector<at::Tensor>& gs) {
    double acc = 0;
    for (const auto& g : gs) {
      if (g.numel() == 0) continue;
      if (inf) acc = std::max(acc, g.abs().max().item<double>());
      else acc += std::pow(g.norm(norm_type).item<double>(), norm_type);
    }
    return acc;
  };
  auto total = torch::tensor({local(sharded_grads)}, torch::kDouble);
  if (reduce)
    comm::all_reduce(norm_group, total, inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum,
                     {comm::Phase::kStep, "clip_grad_norm_"}).wait();
  double t = total.item<double>();
  const double rep = local(replicated_grads);
  t = inf ? std::max(t, rep) : std::pow(t + rep, 1.0 / norm_type);
  const double coef = max_norm / (t + 1e-6);
  if (coef < 1) {
    for (auto& g : sharded_grads) g.mul_(coef);
    for (auto& g : replicated_grads) g.mul_(coef);
  }
  return torch::tensor(t, torch::kFloat);
}

FullyShardedBase::NoSyncGuard::NoSyncGuard(FullyShardedBase* m)
    : m_(m), previous_(m->runtime_->step_policy().no_sync()) {
  m_->runtime_->step_policy().set_no_sync(true);
}
FullyShardedBase::NoSyncGuard::~NoSyncGuard() {
  if (m_) m_->runtime_->step_policy().set_no_sync(previous_);
}

void FullyShardedBase::register_optimizer_in_backward(torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(runtime_->step_policy().optimizer_in_backward(), "fsdp (rank ", pg_.rank(),
              "): register_optimizer_in_backward needs Options::optimizer_in_backward(true) when the model is wrapped");
  TORCH_CHECK(!runtime_->in_backward(), "fsdp (rank ", pg_.rank(), "): register_optimizer_in_backward called "
              "during backward; call it between iterations");
  std::vector<Unit*> units;
  for (auto& u : runtime_->units()) units.push_back(u.get());
  runtime_->step_policy().set_backward_optimizer(
      std::make_unique<core::detail::BackwardOptimizer>(optimizer, units, pg_.rank(), runtime_->cpu_offload()));
}

FullyShardedBase::NoStepGuard::NoStepGuard(FullyShardedBase* m)
    : m_(m), previous_(m->runtime_->step_policy().no_step()) {
  TORCH_CHECK(m->runtime_->step_policy().optimizer_in_backward(), "fsdp (rank ", m->pg_.rank(), "): no_step() holds "
              "back the optimizer step in backward, which only Options::optimizer_in_backward(true) takes; without it "
              "backward never steps");
  m_->runtime_->step_policy().set_no_step(true);
}
FullyShardedBase::NoStepGuard::~NoStepGuard() {
  if (m_) m_->runtime_->step_policy().set_no_step(previous_);
}

void FullyShardedBase::to(torch::Device device, torch::Dtype dtype, bool) {
  TORCH_CHECK(false, "fsdp: FullyShardedDataParallel::to(", device, ", ", dtype,
              ") would break sharding; move and convert the model before wrapping it");
}
void FullyShardedBase::to(torch::Dtype dtype, bool) {
  TORCH_CHECK(false, "fsdp: FullyShardedDataParallel::to(", dtype,
              ") would break sharding; convert the model before wrapping it (or use mixed precision)");
}
void FullyShardedBase::to(torch::Device device, bool) {
  TORCH_CHECK(false, "fsdp: FullyShardedDataParallel::to(", device,
              ") would break sharding; move the model before wrapping it");
}
std::shared_ptr<torch::nn::Module> FullyShardedBase::clone(const c10::optional<torch::Device>&) const {
  TORCH_CHECK(false, "fsdp: FullyShardedDataParallel cannot be cloned (its parameters are shards); "
              "clone the unwrapped model before wrapping, or build a new one and load a full state dict");
}
void FullyShardedBase::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, "fsdp: torch::save of a FullyShardedDataParallel would write this rank's shards "
              "as if they were the model; use fsdp::save_checkpoint or a full state dict");
}
void FullyShardedBase::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "fsdp: torch::load into a FullyShardedDataParallel is not supported; use "
              "fsdp::load_checkpoint or load a full state dict");
}
void FullyShardedBase::pretty_print(std::ostream& stream) const {
  stream << "FullyShardedDataParallel(strategy=" << to_string(options_.sharding_strategy())
         << ", world=" << pg_.size() << ", units=" << runtime_->units().size() << ")";
}

}  // namespace fsdp
