#include "sharded_init_state.h"

#include <mutex>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <set>
#include <sstream>
#include <unordered_map>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/core/wrappable.h"
#include "fsdp/core/sharded_init.h"
#include "path_policy.h"

namespace fsdp {
namespace core::detail {

// [Note: sharded placeholders]
// Between construction and adoption a sharded parameter must keep its full
// shape (parents query it) but must not be read or written (its values live in
// shards across ranks). The parameter is pointed (set_data) at a tensor with its
// full shape, an empty storage and one extra dispatch key, DeferredInit:
// libtorch 1.13 reserves it for torchdistX's deferred initialisation and
// registers no kernel for it. Shape, dtype and device are TensorImpl fields, not
// operators, so they stay queryable; every operator on the parameter reaches the
// boxed fallback below, which names the parameter. set_data copies the key set
// with the rest of the metadata (TensorImpl::shallow_copy_from), so adoption,
// which points the parameter at its piece with the key excluded, removes it.
namespace {

constexpr c10::DispatchKey kPlaceholderKey = c10::DispatchKey::DeferredInit;

std::mutex names_mutex;
std::unordered_map<const c10::TensorImpl*, std::string> placeholder_names;  // for errors

void name_placeholder(const at::Tensor& t, std::string name) {
  std::lock_guard<std::mutex> lock(names_mutex);
  placeholder_names[t.unsafeGetTensorImpl()] = std::move(name);
}

void forget_placeholder(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(names_mutex);
  placeholder_names.erase(t.unsafeGetTensorImpl());
}

std::string placeholder_name(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(names_mutex);
  auto it = placeholder_names.find(t.unsafeGetTensorImpl());
  return it == placeholder_names.end() ? "<unnamed>" : it->second;
}

bool has_placeholder_key(const at::Tensor& t) { return t.defined() && t.key_set().has(kPlaceholderKey); }

// Operators that only read or change autograd metadata pass through.
bool metadata_only(const std::string& op) {
  static const std::set<std::string> ops = {"aten::requires_grad_", "aten::retain_grad", "aten::retains_grad",
                                            "aten::is_leaf", "aten::output_nr", "aten::_version",
                                            "aten::size", "aten::stride", "aten::dim", "aten::numel",
                                            "aten::sym_size", "aten::sym_numel", "aten::sym_stride",
                                            "aten::is_floating_point", "aten::is_complex"};
  return ops.count(op) > 0;
}

void placeholder_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const std::string& name = op.schema().name();
  if (metadata_only(name)) {
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kPlaceholderKey), stack);
    return;
  }
  std::string params;
  auto note = [&](const at::Tensor& t) {
    if (!has_placeholder_key(t)) return;
    params += (params.empty() ? "" : ", ") + placeholder_name(t);
  };
  for (const auto& v : torch::jit::last(*stack, op.schema().arguments().size())) {
    if (v.isTensor()) note(v.toTensor());
    else if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList().vec()) note(t);
  }
  TORCH_CHECK(false, "fsdp: ", name, " on parameter ", params,
              ", which a ShardedInitContext sharded when its module was constructed: its values now live in "
              "shards across the ranks, so it cannot be read or written before FullyShardedDataParallel "
              "adopts it (its shape, dtype and device stay queryable). To initialise it, use "
              "Options::param_init_fn (run on each unit's module with its full parameters just before it "
              "is sharded); after wrapping, use apply_with_full_params");
}

void ensure_placeholder_fallback() {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> library;
  std::call_once(once, [] {
    TORCH_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kPlaceholderKey),
                "fsdp: ShardedInitContext needs the DeferredInit dispatch key for its placeholders, but another "
                "library (torchdistX?) registered a fallback for it; do not combine the two");
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kPlaceholderKey, __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&placeholder_fallback>());
  });
}

// Full shape, empty storage, the placeholder key.
at::Tensor make_placeholder(const at::Tensor& piece, const std::vector<int64_t>& shape) {
  at::Tensor empty = at::empty({0}, piece.options().requires_grad(false));
  const auto backend = c10::computeDispatchKey(piece.scalar_type(), piece.layout(), piece.device());
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(empty.storage()), c10::DispatchKeySet(backend) | c10::DispatchKeySet(kPlaceholderKey),
      piece.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

std::string describe_precision(const FlatPrecision& p) {
  std::ostringstream os;
  os << "param_dtype " << (p.param_dtype ? c10::toString(*p.param_dtype) : "-") << ", reduce_dtype "
     << (p.reduce_dtype ? c10::toString(*p.reduce_dtype) : "-")
     << (p.keep_low_precision_grads ? ", low-precision grads" : "");
  return os.str();
}

}  // namespace

std::string describe(const ShardingSignature& s) {
  std::ostringstream os;
  os << "group '" << s.group_name << "', " << to_string(s.strategy) << ", shard " << s.layout.rank << " of "
     << s.layout.world << (s.layout.sharded ? "" : " (unsharded)") << ", " << describe_precision(s.precision);
  return os.str();
}

bool same_sharding(const ShardingSignature& a, const ShardingSignature& b) {
  return a.group == b.group && a.strategy == b.strategy && a.layout.rank == b.layout.rank &&
         a.layout.world == b.layout.world && a.layout.sharded == b.layout.sharded &&
         a.precision.param_dtype == b.precision.param_dtype && a.precision.reduce_dtype == b.precision.reduce_dtype &&
         a.precision.keep_low_precision_grads == b.precision.keep_low_precision_grads;
}

ShardingSignature sharding_signature(const comm::ProcessGroup& pg, const ResolvedOptions& resolved,
                                     at::ScalarType param_dtype) {
  ShardingSignature s;
  s.group = pg.c10d().get();
  s.group_name = pg.name();
  s.strategy = resolved.strategy;
  s.layout = shard_layout(resolved, pg);
  s.precision = unit_precision(resolved.mixed_precision, param_dtype, /*full_precision_unit=*/false);
  return s;
}

ConstructionUnit::~ConstructionUnit() {
  if (!flat) return;
  for (const auto& e : flat->entries()) forget_placeholder(e.param);
}

std::map<const torch::nn::Module*, ConstructionUnit*> find_construction_units(torch::nn::Module& model) {
  std::map<const torch::nn::Module*, ConstructionUnit*> out;
  for (const auto& m : model.modules()) {
    auto* w = dynamic_cast<WrappableBase*>(m.get());
    if (w == nullptr || !w->fsdp_construction_units()) continue;
    for (auto& u : w->fsdp_construction_units()->units)
      if (u->flat) out[u->module] = u.get();
  }
  return out;
}

std::unique_ptr<FlatParameter> adopt_construction_unit(ConstructionUnit& unit) {
  TORCH_INTERNAL_ASSERT(unit.flat, "construction unit adopted twice");
  for (const auto& e : unit.flat->entries()) forget_placeholder(e.param);
  {
    c10::impl::ExcludeDispatchKeyGuard no_placeholder(kPlaceholderKey);
    unit.flat->use_shard_views();
  }
  return std::move(unit.flat);
}

// The state of one ShardedInitContext ([Note: sharded construction]).
class ShardedInitState {
 public:
  ShardedInitState(comm::ProcessGroup pg, Options options) : pg_(std::move(pg)) {
    TORCH_CHECK(pg_.defined(), "fsdp: ShardedInitContext needs a process group; call "
                "fsdp::comm::init_process_group() first");
    resolved_ = resolve_options(options, pg_);
    options_ = std::move(options);
    const Options& o = options_;
    TORCH_CHECK(o.auto_wrap_policy(), "fsdp (rank ", pg_.rank(), "): ShardedInitContext needs Options::auto_wrap_policy: "
                "without one the whole model is a single unit, which exists only once the model is complete. "
                "Use module_type_policy<YourBlockImpl>(), size_based_policy(n) or always_wrap_policy() with "
                "fsdp::Wrappable members");
    TORCH_CHECK(!is_path_policy(o.auto_wrap_policy()), "fsdp (rank ", pg_.rank(),
                "): path_policy cannot be used inside a ShardedInitContext: a module's path exists only after its "
                "parent registers it, which is after its constructor returned. Use module_type_policy<...>(), "
                "size_based_policy(n) or always_wrap_policy()");
    TORCH_CHECK(o.ignored_modules().empty(), "fsdp (rank ", pg_.rank(), "): Options::ignored_modules cannot be "
                "given to a ShardedInitContext (the modules do not exist yet); construct ignored parts outside the "
                "context, or pass ignored_modules only to FullyShardedDataParallel for modules that are not "
                "Wrappables chosen by the policy");
    TORCH_CHECK(!o.cpu_offload(), "fsdp (rank ", pg_.rank(), "): Options::cpu_offload cannot be given to a "
                "ShardedInitContext: its shards are made on the model's device. Construct the model without the "
                "context and wrap it with cpu_offload(true)");
    layout_ = shard_layout(resolved_, pg_);
    ensure_placeholder_fallback();
  }

  void on_constructed(torch::nn::Module& m, WrappableBase& w) {
    const IgnoredModules none;
    auto decided = [this](const torch::nn::Module& c) { return sharded_.count(&c) > 0; };
    const Options& o = options_;
    std::vector<PlannedUnit> planned = walk_wrap_policy(m, o.auto_wrap_policy(), none, true, decided);
    const auto& mp = o.mixed_precision();
    if (mp.param_dtype() && mp.full_precision_batch_norm()) add_batch_norm_units(m, none, planned);
    assign_parameters(m, none, planned);
    for (auto& p : planned) {
      if (p.kind != PlannedUnit::Kind::kCallSite || p.entries.empty() || sharded_.count(p.identity)) continue;
      shard(m, w, p);
    }
    // Placeholders are named relative to the outermost Wrappable built so far.
    for (const auto& p : m.named_parameters())
      if (has_placeholder_key(p.value())) name_placeholder(p.value(), "'" + p.key() + "' (in a " + m.name() + ")");
  }

  int64_t units() const { return units_; }
  int64_t numel() const { return numel_; }

 private:
  static bool is_path_policy(const WrapPolicy& policy) { return policy.target<PathPolicy>() != nullptr; }

  void shard(torch::nn::Module& m, WrappableBase& w, PlannedUnit& p) {
    check_one_dtype_and_device(p);
    run_param_init_fn(options_.param_init_fn(), m, p);
    torch::NoGradGuard no_grad;
    if (options_.sync_module_states())
      for (auto& e : p.entries) comm::broadcast(pg_, e.param.detach(), 0, {comm::Phase::kSetup, "sharded construction"}).wait();
    auto cu = std::make_unique<ConstructionUnit>();
    cu->module = p.identity;
    cu->relative_path = p.path;
    cu->signature = sharding_signature(pg_, resolved_, p.entries.front().param.scalar_type());
    int64_t numel = 0;
    for (const auto& e : p.entries) numel += e.numel;
    // Copies this rank's chunk into the shard and points the parameters at
    // their pieces: the full values are freed here.
    cu->flat = std::make_unique<FlatParameter>(std::move(p.entries), layout_.rank, layout_.world, layout_.sharded,
                                               cu->signature.precision);
    {
      c10::impl::ExcludeDispatchKeyGuard no_placeholder(kPlaceholderKey);
      for (auto& e : cu->flat->entries()) e.param.set_data(make_placeholder(e.param, e.shape));
    }
    // The unit's full values were just freed. glibc keeps freed heap pages (the
    // full blocks lie between shards, so the heap cannot shrink from the top):
    // hand them back now, or the process keeps the model's size resident.
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    if (!w.fsdp_construction_units()) w.fsdp_construction_units() = std::make_shared<ConstructionUnits>();
    w.fsdp_construction_units()->units.push_back(std::move(cu));
    sharded_.insert(p.identity);
    ++units_;
    numel_ += numel;
  }

  comm::ProcessGroup pg_;
  Options options_;           // as given: the construction-time choices (policy, init, sync)
  ResolvedOptions resolved_;
  ShardLayout layout_;
  std::set<const torch::nn::Module*> sharded_;  // modules that are units sharded by this context
  int64_t units_ = 0;
  int64_t numel_ = 0;
};

namespace {
thread_local ShardedInitState* current_context = nullptr;
}  // namespace

void on_wrappable_constructed(torch::nn::Module& module, WrappableBase& base) {
  if (current_context == nullptr) return;
  current_context->on_constructed(module, base);
}

}  // namespace core::detail

ShardedInitContext::ShardedInitContext(comm::ProcessGroup pg, Options options) {
  TORCH_CHECK(core::detail::current_context == nullptr,
              "fsdp: a ShardedInitContext is already alive on this thread; use one per model");
  state_ = std::make_unique<core::detail::ShardedInitState>(std::move(pg), std::move(options));
  core::detail::current_context = state_.get();
}

ShardedInitContext::~ShardedInitContext() {
  core::detail::current_context = nullptr;
  if (state_->units() == 0)
    TORCH_WARN("fsdp: a ShardedInitContext ended without sharding anything: no fsdp::Wrappable constructed inside "
               "it was chosen by the wrap policy. torch::nn::Sequential entries are not Wrappables and are "
               "sharded only by FullyShardedDataParallel; declare blocks as fsdp::Wrappable<Impl> members");
}

int64_t ShardedInitContext::units_sharded() const { return state_->units(); }
int64_t ShardedInitContext::numel_sharded() const { return state_->numel(); }

bool is_sharded_placeholder(const at::Tensor& param) { return core::detail::has_placeholder_key(param); }

}  // namespace fsdp
