#include "unit_plan.h"

#include <map>
#include <set>

#include <torch/csrc/autograd/grad_mode.h>

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include "fsdp/core/wrappable.h"
#include "path_policy.h"

namespace fsdp::core::detail {

std::string join_path(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

std::string module_path_of(const std::string& fqn) {
  auto dot = fqn.rfind('.');
  return dot == std::string::npos ? "" : fqn.substr(0, dot);
}

bool path_within(const std::string& path, const std::string& prefix) {
  return prefix.empty() || path == prefix || path.rfind(prefix + ".", 0) == 0;
}

bool is_batch_norm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) != nullptr;
}

IgnoredModules::IgnoredModules(torch::nn::Module& model,
                               const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::map<const torch::nn::Module*, std::string> path_of;
  for (const auto& item : model.named_modules()) path_of[item.value().get()] = item.key();
  for (const auto& m : modules) {
    auto it = path_of.find(m.get());
    TORCH_CHECK(it != path_of.end(), "fsdp: an ignored module (", m->name(), ") is not part of the wrapped model");
    paths_.push_back(it->second);
  }
}

bool IgnoredModules::contains(const std::string& path) const {
  for (const auto& ip : paths_)
    if (path_within(path, ip)) return true;
  return false;
}

namespace unit_plan_detail {

// path_policy's paths, checked against the modules the walk visits: each must name at least
// one module, and every module it names must be a wrap candidate (a path the policy would
// silently never wrap is a unit the user expects and does not get).
class PathPolicyCheck {
 public:
  explicit PathPolicyCheck(const WrapPolicy& policy) : policy_(policy ? policy.target<PathPolicy>() : nullptr) {
    if (policy_) used_.assign(policy_->paths.size(), false);
  }

  /// Whether the policy is a path_policy (which makes ModuleList and ModuleDict entries candidates).
  bool active() const { return policy_ != nullptr; }

  void visited(const std::string& path, const torch::nn::Module& m, bool candidate) {
    if (!policy_) return;
    for (size_t i = 0; i < policy_->paths.size(); ++i) {
      if (!path_matches(policy_->paths[i], path)) continue;
      used_[i] = true;
      TORCH_CHECK(candidate, "fsdp: path_policy names '", path, "' (", m.name(), "), which cannot become a unit: "
                  "the C++ frontend has no module hooks and forward() is not virtual, so a unit needs a call site "
                  "the library owns ([Note: wrap candidates] in fsdp/core/wrappable.h). Declare that member as "
                  "fsdp::Wrappable<", m.name(), "> instead of its holder (same parameters and names), or make it "
                  "an entry of a torch::nn::Sequential, or of a ModuleList or ModuleDict that forward() calls "
                  "through fsdp::call (fsdp/core/call.h)");
    }
  }

  void check() const {
    if (!policy_) return;
    for (size_t i = 0; i < used_.size(); ++i)
      TORCH_CHECK(used_[i], "fsdp: path_policy names '", policy_->paths[i], "', which matches no module of the "
                  "model (paths as named_modules() gives them, e.g. \"blocks.3\"; `*` stands for one component's "
                  "characters, e.g. \"blocks.*\")");
  }

 private:
  const PathPolicy* policy_;
  std::vector<bool> used_;
};

}  // namespace unit_plan_detail

std::vector<PlannedUnit> walk_wrap_policy(torch::nn::Module& model, const WrapPolicy& policy,
                                          const IgnoredModules& ignored, bool model_is_candidate,
                                          const DecidedUnit& decided) {
  struct Candidate {
    PlannedUnit unit;
    bool wrap = false;
  };
  std::vector<Candidate> candidates;  // every child, in pre-order
  unit_plan_detail::PathPolicyCheck names(policy);
  std::function<int64_t(torch::nn::Module&, const std::string&)> visit =
      [&](torch::nn::Module& m, const std::string& path) -> int64_t {
    int64_t n = 0;
    for (const auto& p : m.named_parameters(false)) n += p.value().numel();
    auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m);
    // fsdp::call's entries: candidates for path_policy only (include/fsdp/core/call.h).
    const bool calls_entries = names.active() && (dynamic_cast<torch::nn::ModuleListImpl*>(&m) != nullptr ||
                                                  dynamic_cast<torch::nn::ModuleDictImpl*>(&m) != nullptr);
    size_t i = 0;
    for (const auto& c : m.named_children()) {
      const size_t index = i++;
      const std::string cp = join_path(path, c.key());
      if (ignored.contains(cp)) continue;
      const size_t slot = candidates.size();
      Candidate cand;
      cand.unit.path = cp;
      cand.unit.module = c.value();
      cand.unit.identity = c.value().get();
      if (seq) cand.unit.sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m.shared_from_this());
      cand.unit.index = index;
      candidates.push_back(std::move(cand));
      if (decided && decided(*c.value())) {
        candidates[slot].wrap = true;  // its subtree was planned when it was constructed
        continue;
      }
      int64_t cn = visit(*c.value(), cp);
      const bool wrappable = dynamic_cast<WrappableBase*>(c.value().get()) != nullptr;
      candidates[slot].unit.list_entry = calls_entries && !wrappable;
      const bool candidate = seq != nullptr || wrappable || candidates[slot].unit.list_entry;
      names.visited(cp, *c.value(), candidate);
      if (candidate && policy && policy(cp, *c.value(), cn)) {
        candidates[slot].wrap = true;
        cn = 0;
      }
      n += cn;
    }
    return n;
  };
  const int64_t unwrapped = visit(model, "");
  names.check();
  std::vector<PlannedUnit> units(1);
  units[0].kind = PlannedUnit::Kind::kRoot;
  units[0].identity = &model;
  if (model_is_candidate && policy && policy("", model, unwrapped)) {
    PlannedUnit self;
    self.kind = PlannedUnit::Kind::kCallSite;
    self.identity = &model;
    units.push_back(std::move(self));
  }
  for (auto& c : candidates)
    if (c.wrap) units.push_back(std::move(c.unit));
  return units;
}

void add_batch_norm_units(torch::nn::Module& model, const IgnoredModules& ignored, std::vector<PlannedUnit>& units) {
  auto add = [&](const std::string& path, const torch::nn::Module& m) {
    if (!is_batch_norm(m) || ignored.contains(path) || m.parameters(false).empty()) return;
    PlannedUnit u;
    u.kind = PlannedUnit::Kind::kBatchNorm;
    u.path = path;
    u.identity = &m;
    units.push_back(std::move(u));
  };
  // Not include_self: `model` may still be inside its constructor (ShardedInitContext),
  // where it has no shared_ptr yet.
  add("", model);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) add(item.key(), *item.value());
}

void assign_parameters(torch::nn::Module& model, const IgnoredModules& ignored, std::vector<PlannedUnit>& units) {
  std::map<std::string, size_t> bn_unit_of;
  for (size_t u = 0; u < units.size(); ++u)
    if (units[u].kind == PlannedUnit::Kind::kBatchNorm) bn_unit_of[units[u].path] = u;
  std::map<const c10::TensorImpl*, std::pair<size_t, std::string>> seen;
  for (const auto& p : model.named_parameters()) {
    const std::string mpath = module_path_of(p.key());
    if (ignored.contains(mpath)) continue;
    size_t owner = 0;
    for (size_t u = 1; u < units.size(); ++u)
      if (units[u].kind == PlannedUnit::Kind::kCallSite && path_within(mpath, units[u].path) &&
          units[u].path.size() >= units[owner].path.size())
        owner = u;
    if (auto bn = bn_unit_of.find(mpath); bn != bn_unit_of.end()) owner = bn->second;
    auto it = seen.find(p.value().unsafeGetTensorImpl());
    if (it != seen.end()) {
      TORCH_CHECK(it->second.first == owner, "fsdp: parameter '", p.key(), "' (module '", mpath,
                  "') is tied to '", it->second.second, "' (module '", module_path_of(it->second.second),
                  "'), but they fall in different units ('", units[owner].path, "' and '",
                  units[it->second.first].path,
                  "'). Tied parameters must share a unit: wrap their common parent instead");
      continue;  // tied inside one unit: flattened once
    }
    seen[p.value().unsafeGetTensorImpl()] = {owner, p.key()};
    FlatParamEntry e;
    e.fqn = p.key();
    e.module_path = mpath;
    e.param = p.value();
    e.shape = p.value().sizes().vec();
    e.numel = p.value().numel();
    units[owner].entries.push_back(std::move(e));
  }
}

void run_param_init_fn(const ParamInitFn& fn, torch::nn::Module& root, const PlannedUnit& p) {
  if (!fn) return;
  std::set<std::string> owners;
  for (const auto& e : p.entries) owners.insert(e.module_path);
  torch::NoGradGuard no_grad;
  // Not include_self: root may still be inside its constructor (ShardedInitContext),
  // where it has no shared_ptr yet.
  if (owners.count("")) fn(root);
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    if (owners.count(item.key())) fn(*item.value());
}

void check_one_dtype_and_device(const PlannedUnit& p) {
  const auto& first = p.entries.front();
  for (const auto& e : p.entries) {
    TORCH_CHECK(e.param.scalar_type() == first.param.scalar_type() && e.param.device() == first.param.device(),
                "fsdp: unit '", p.path, "' mixes ", first.param.scalar_type(), " on ", first.param.device(), " ('",
                first.fqn, "') with ", e.param.scalar_type(), " on ", e.param.device(), " ('", e.fqn,
                "'); one unit holds one dtype and device: wrap "
                "these modules as separate units or convert the model first");
  }
}

ShardLayout shard_layout(const ResolvedOptions& resolved, const comm::ProcessGroup& pg) {
  const auto strategy = resolved.strategy;
  ShardLayout l;
  if (strategy == ShardingStrategy::kHybridShard) {
    // split_consecutive: blocks {0..g-1}, {g..2g-1}, ...
    l.world = resolved.shard_group_size;
    l.rank = pg.rank() % l.world;
  } else {
    l.world = pg.size();
    l.rank = pg.rank();
  }
  l.sharded = strategy != ShardingStrategy::kNoShard && !(strategy == ShardingStrategy::kHybridShard && l.world == 1);
  return l;
}

}  // namespace fsdp::core::detail
