// ZeroRedundancyOptimizer (ZeRO-1 / ZeRO-2 on an unmodified module) against
// single-process training on the global batch, compared after every step, at N=1..3
// (N=4: one case per stage); and checkpoint directories shared with FSDP (below):
//  * stage 1 (all-reduce and reduce-scatter variants) and stage 2 (with and without
//    overlap), SGD with momentum, AdamW with a no-decay group, CPUAdam;
//  * odd sizes (every bucket needs padding at N=2,3), small buckets so that buckets,
//    chunks and parameters cut each other, and one bucket for everything;
//  * an unused branch: used by one rank at some steps, by none at others (then its
//    gradients are undefined everywhere and the optimizers must skip it: checked to be
//    bit-identical across those steps);
//  * a frozen layer (never changes, not partitioned), gradient accumulation over
//    micro-batches (no implicit 1/k), global-norm clipping, an LR scheduler;
//  * construction broadcasts rank 0's parameters; TensorImpls survive.
// Exactness: the reference computes every rank's gradient of every micro-batch
// separately and sums them as the stage does (ranks in rank order, then / N, which is
// what the shared-memory reduce-scatter and all-reduce do; stage 1 accumulates
// micro-batches before the reduction, stage 2 after), so without clipping the results
// must be bit-identical at every N. With clipping, the global norm is summed from
// per-piece fp32 norms where clip_grad_norm_ takes the norm of per-parameter norms: the
// coefficient may differ in its last bits, asserted < 1e-5 relative L2 (as the FSDP
// parity tests).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/counting_allocator.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/optim/cpu_adam.h"
#include "fsdp/trainer/training_facade.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/state/zero_checkpoint.h"
#include "fsdp/state/zero_state_dict.h"
#include "harness/device_memory_probe.h"
#include "harness/models.h"
#include "harness/multirank.h"

// White-box: the layout's arithmetic; the reference optimizer's state by parameter.
#include "harness/test_dir.h"
#include "memory/device_memory.h"
#include "optim/zero_layout.h"
#include "engine/placement.h"
#include "state/optim_state.h"

using namespace fsdp;
using namespace fsdp::testing;
using fsdp::memory::install_counting_allocator;
using fsdp::optim::Stage1Reduction;
using fsdp::optim::ZeroOptions;
using fsdp::optim::ZeroRedundancyOptimizer;

namespace {

// An unmodified module: no wrapper, no marks. 1,158 trainable elements in tensors of
// 403, 31, 527, 17, 85, 5, 85, 5; a frozen 17x17 layer; a branch used on demand.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(13, 31));
    fc2 = register_module("fc2", torch::nn::Linear(31, 17));
    frozen = register_module("frozen", torch::nn::Linear(17, 17));
    head = register_module("head", torch::nn::Linear(17, 5));
    branch = register_module("branch", torch::nn::Linear(17, 5));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x, bool use_branch) {
    x = torch::relu(fc1->forward(x));
    x = torch::tanh(fc2->forward(x));
    x = x + torch::tanh(frozen->forward(x));
    auto y = head->forward(x);
    if (use_branch) y = y + branch->forward(x);
    return y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, frozen{nullptr}, head{nullptr}, branch{nullptr};
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(0);
  return Net();
}

enum class Opt { SGD, AdamW, CPUAdam };

// Weights decay, biases do not (AdamW / CPUAdam); SGD: one group, no options.
std::vector<torch::optim::OptimizerParamGroup> make_groups(Opt opt, torch::nn::Module& m) {
  if (opt == Opt::SGD) return {torch::optim::OptimizerParamGroup(m.parameters())};
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : m.named_parameters())
    (p.key().find("bias") != std::string::npos ? no_decay : decay).push_back(p.value());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (opt == Opt::AdamW) {
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(1e-2).weight_decay(0.1)));
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(1e-2).weight_decay(0.0)));
  } else {
    groups.emplace_back(decay, std::make_unique<fsdp::optim::CPUAdamOptions>(
                                   fsdp::optim::CPUAdamOptions(1e-2).weight_decay(0.1).adamw_mode(true)));
    groups.emplace_back(no_decay, std::make_unique<fsdp::optim::CPUAdamOptions>(
                                      fsdp::optim::CPUAdamOptions(1e-2).weight_decay(0.0).adamw_mode(true)));
  }
  return groups;
}

const torch::optim::SGDOptions kSgd = torch::optim::SGDOptions(0.05).momentum(0.9);

std::unique_ptr<torch::optim::Optimizer> make_reference_optimizer(Opt opt, torch::nn::Module& m) {
  auto groups = make_groups(opt, m);
  std::unique_ptr<torch::optim::Optimizer> ref;
  switch (opt) {
    case Opt::SGD: ref = std::make_unique<torch::optim::SGD>(groups, kSgd); break;
    case Opt::AdamW: ref = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(1e-2)); break;
    case Opt::CPUAdam: ref = std::make_unique<fsdp::optim::CPUAdam>(groups, fsdp::optim::CPUAdamOptions(1e-2)); break;
  }
  // The groups' options as given on every 2.x (the ZeRO side keeps them through inner_optimizer).
  fsdp::optim::keep_group_options(*ref, groups);
  return ref;
}

fsdp::optim::InnerOptimizerFactory make_factory(Opt opt) {
  switch (opt) {
    case Opt::SGD: return fsdp::optim::inner_optimizer<torch::optim::SGD>(kSgd);
    case Opt::AdamW: return fsdp::optim::inner_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2));
    case Opt::CPUAdam:
      return fsdp::optim::inner_optimizer<fsdp::optim::CPUAdam>(fsdp::optim::CPUAdamOptions(1e-2));
  }
  return nullptr;
}

struct Case {
  std::string name;
  int stage = 1;
  Stage1Reduction reduction = Stage1Reduction::kAllReduce;
  Opt opt = Opt::AdamW;
  int64_t bucket = 100;  // elements
  int accum = 1;         // micro-batches per step
  double clip = 0;
  bool overlap = false;
  bool scheduler = false;
  bool state_dict = false;  // consolidate, compare with the reference's state, reload
  bool zero_in_place = false;  // zero_grad(false): gradients zeroed and accumulated into in place
  bool offload = false;        // ZeroOptions::cpu_offload (host and device are one memory here)
  bool auto_placement = false;  // and gpu_margin_mem_ratio, with a device-memory probe (below)
};

// gpu_margin_mem_ratio: the probe's budget is half the bytes the Adam masters and state take (12
// per element): some buckets move to the "device", the others stay.

// Rank s % (n + 1) uses the branch at step s; at s % (n + 1) == n no rank does.
bool uses_branch(int step, int rank, int n) { return step % (n + 1) == rank; }
bool branch_unused(int step, int n) { return step % (n + 1) == n; }

constexpr int kSteps = 4;
constexpr int64_t kPerRank = 4;  // samples per rank and micro-batch

void set_grads_to_none(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad().reset();
}

// After the first step under gpu_margin_mem_ratio: some buckets moved, not all; what moved
// (masters and Adam state, 4 + 8 bytes per element) fits the budget; the rest is counted on the
// host: the whole host partition, the gradients' host copy and the state left there.
void expect_auto_placement(ZeroRedundancyOptimizer& opt, int64_t budget, int n) {
  EXPECT_GT(opt.num_buckets_on_device(), 0);
  EXPECT_LT(opt.num_buckets_on_device(), opt.num_buckets());
  const MemoryUsage u = opt.get_memory_usage();
  const int64_t part = 4 * opt.partition_numel();
  const int64_t device_masters = u[MemoryCategory::kMasterWeights] - part;
  const int64_t host_state = u.offloaded_bytes - part - part;
  const int64_t device_state = u[MemoryCategory::kOptimizerState] - host_state;
  EXPECT_GT(device_masters, 0);
  // Adam: two moments per element of a piece; a moved chunk also holds its bucket's padding
  // (< N elements), which has no state.
  EXPECT_LE(device_state, 2 * device_masters);
  EXPECT_GT(device_state, 2 * (device_masters - 4 * int64_t(n) * opt.num_buckets_on_device()));
  EXPECT_LE(device_masters + device_state, budget);
  EXPECT_GT(host_state, 0);
}

void check_case(comm::ProcessGroup& pg, const Case& c) {
  run_case(c.name, [&] {
    const int n = pg.size(), rank = pg.rank();
    // Reference: one process computing every rank's gradients (see the file header).
    auto ref = make_net();
    std::map<std::string, torch::Tensor> initial;
    for (const auto& p : ref->named_parameters()) initial[p.key()] = p.value().detach().clone();
    auto ref_opt = make_reference_optimizer(c.opt, *ref);
    std::unique_ptr<torch::optim::StepLR> ref_sched;
    if (c.scheduler) ref_sched = std::make_unique<torch::optim::StepLR>(*ref_opt, 1, 0.5);

    // Ours: ranks other than 0 start from different values; construction must
    // broadcast rank 0's (the reference's).
    auto model = make_net();
    if (rank != 0) {
      torch::NoGradGuard g;
      for (auto& p : model->parameters()) p.add_(1.0 + rank);
    }
    std::vector<const c10::TensorImpl*> identity;
    for (auto& p : model->parameters()) identity.push_back(p.unsafeGetTensorImpl());
    ZeroOptions options = ZeroOptions()
                              .process_group(pg)
                              .stage(c.stage)
                              .stage1_reduction(c.reduction)
                              .reduce_bucket_size(c.bucket)
                              .overlap_communication(c.overlap)
                              .clip_grad_norm(c.clip)
                              .cpu_offload(c.offload)
                              .gpu_margin_mem_ratio(c.auto_placement ? DeviceMemoryProbe::kRatio : 0.0)
                              .module(model.ptr());
    std::optional<DeviceMemoryProbe> probe;
    if (c.auto_placement) probe.emplace();
    ZeroRedundancyOptimizer opt(make_groups(c.opt, *model), make_factory(c.opt), options);
    for (const auto& p : model->named_parameters())
      ASSERT_TRUE(torch::equal(p.value(), initial[p.key()])) << "not broadcast from rank 0: " << p.key();
    if (probe) probe->budget = 6 * opt.partition_numel();
    std::unique_ptr<torch::optim::StepLR> sched;
    if (c.scheduler) sched = std::make_unique<torch::optim::StepLR>(opt, 1, 0.5);

    // Under zero_grad(false) a parameter no rank used keeps a zero gradient and is
    // stepped (torch::optim's rule), which the reference would have to mimic: every
    // rank uses the branch every step instead.
    auto uses = [&](int s, int r) { return c.zero_in_place || uses_branch(s, r, n); };
    // Bit-identical to the reference without clipping (see the file header).
    const bool exact = c.clip == 0;
    const double tol = 1e-5;
    for (int s = 0; s < kSteps; ++s) {
      // Every rank's gradient of every micro-batch, then summed the way the stage sums
      // them: stage 1 accumulates micro-batches on each rank and reduces once; stage 2
      // reduces each micro-batch and accumulates the results. A reduction adds ranks in
      // rank order (zeros for a rank without a gradient) and divides by n.
      auto ref_params = ref->parameters();
      const size_t np = ref_params.size();
      std::vector<std::vector<std::vector<torch::Tensor>>> g(n, std::vector<std::vector<torch::Tensor>>(c.accum));
      for (int mb = 0; mb < c.accum; ++mb) {
        auto [x, y] = global_batch(10 * s + mb, kPerRank * n);
        for (int r = 0; r < n; ++r) {
          set_grads_to_none(*ref);
          torch::mse_loss(ref->forward(rank_slice(x, r, n), uses(s, r)), rank_slice(y, r, n)).backward();
          for (auto& p : ref_params) g[r][mb].push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
        }
      }
      auto add = [](torch::Tensor acc, const torch::Tensor& t) {
        if (!t.defined()) return acc;
        return acc.defined() ? acc + t : t.clone();
      };
      auto reduce = [&](const std::vector<torch::Tensor>& per_rank, const torch::Tensor& like) {
        bool any = false;
        for (const auto& t : per_rank) any = any || t.defined();
        if (!any) return torch::Tensor();
        auto sum = torch::zeros_like(like);
        for (const auto& t : per_rank)
          if (t.defined()) sum += t;
        return sum / n;
      };
      set_grads_to_none(*ref);
      for (size_t i = 0; i < np; ++i) {
        torch::Tensor total;
        if (c.stage == 1) {
          std::vector<torch::Tensor> per_rank(n);
          for (int r = 0; r < n; ++r)
            for (int mb = 0; mb < c.accum; ++mb) per_rank[r] = add(per_rank[r], g[r][mb][i]);
          total = reduce(per_rank, ref_params[i]);
        } else {
          for (int mb = 0; mb < c.accum; ++mb) {
            std::vector<torch::Tensor> per_rank(n);
            for (int r = 0; r < n; ++r) per_rank[r] = g[r][mb][i];
            total = add(total, reduce(per_rank, ref_params[i]));
          }
        }
        if (total.defined()) ref_params[i].mutable_grad() = total;
      }
      if (c.clip > 0) torch::nn::utils::clip_grad_norm_(ref->parameters(), c.clip);
      auto branch_before = ref->branch->weight.detach().clone();
      ref_opt->step();
      if (ref_sched) ref_sched->step();
      if (branch_unused(s, n) && !c.zero_in_place) {
        ASSERT_TRUE(torch::equal(branch_before, ref->branch->weight));
      }

      opt.zero_grad(/*set_to_none=*/!c.zero_in_place);
      auto ours_before = model->branch->weight.detach().clone();
      for (int mb = 0; mb < c.accum; ++mb) {
        auto [x, y] = global_batch(10 * s + mb, kPerRank * n);
        torch::mse_loss(model->forward(rank_slice(x, rank, n), uses(s, rank)), rank_slice(y, rank, n))
            .backward();
        if (c.stage == 2) {
          for (auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << "stage 2 keeps no full gradient";
        }
      }
      opt.step();
      if (probe && s == 0) expect_auto_placement(opt, probe->budget, n);
      if (sched) sched->step();
      if (branch_unused(s, n) && !c.zero_in_place) {
        EXPECT_TRUE(torch::equal(ours_before, model->branch->weight)) << "unused everywhere: must be skipped";
      }
      if (c.clip > 0) {
        EXPECT_GT(opt.last_grad_norm(), c.clip) << "the case should clip";
      }

      for (const auto& p : ref->named_parameters()) {
        torch::Tensor ours = model->named_parameters()[p.key()];
        if (exact) {
          EXPECT_TRUE(torch::equal(ours, p.value())) << "step " << s << " " << p.key() << " rel "
                                                     << rel_diff(ours, p.value());
          // Stage 1 all-reduce leaves every rank the averaged gradients, as DDP does (our
          // grad() shares the reduced bucket's memory).
          if (c.stage == 1 && c.reduction == Stage1Reduction::kAllReduce && p.value().grad().defined()) {
            EXPECT_TRUE(torch::equal(ours.grad(), p.value().grad())) << "step " << s << " grad of " << p.key();
          }
        } else {
          EXPECT_LT(rel_diff(ours, p.value()), tol) << "step " << s << " " << p.key();
        }
      }
    }
    // Frozen parameters never move; identities survive.
    EXPECT_TRUE(torch::equal(model->frozen->weight, initial["frozen.weight"]));
    auto params = model->parameters();
    ASSERT_EQ(params.size(), identity.size());
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].unsafeGetTensorImpl(), identity[i]);
    if (c.state_dict) {
      // Rank 0's consolidated dict holds the reference's state (by name, full shapes).
      auto osd = consolidate_state_dict(opt, 0);
      if (rank == 0) {
        size_t with_state = 0;
        for (const auto& p : ref->named_parameters()) {
          auto st = fsdp::state::get_param_state(*ref_opt, p.value());
          ASSERT_EQ(st.has_value(), osd.state.count(p.key()) == 1) << p.key();
          if (!st) continue;
          ++with_state;
          const auto& entry = osd.state.at(p.key());
          if (entry.count("step")) {
            EXPECT_EQ(entry.at("step").item<int64_t>(), st->step) << p.key();
          }
          for (const auto& t : st->tensors) {
            ASSERT_TRUE(entry.count(t.first)) << p.key() << " " << t.first;
            EXPECT_TRUE(torch::equal(entry.at(t.first), t.second)) << p.key() << " " << t.first;
          }
        }
        EXPECT_EQ(osd.state.size(), with_state);
      } else {
        EXPECT_TRUE(osd.empty());
      }
      // Loaded into a fresh optimizer over a copy of the model, one more step matches.
      OptimStateDict mine;
      for (int r = 0; r < n; ++r) {
        auto d = consolidate_state_dict(opt, r);
        if (r == rank) mine = d;
      }
      auto model2 = make_net();
      {
        torch::NoGradGuard ng;
        auto a = model->parameters(), b = model2->parameters();
        for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
      }
      ZeroRedundancyOptimizer opt2(make_groups(c.opt, *model2), make_factory(c.opt), options.module(model2.ptr()));
      load_consolidated_state_dict(opt2, mine);
      auto [x, y] = global_batch(999, kPerRank * n);
      auto xs = rank_slice(x, rank, n), ys = rank_slice(y, rank, n);
      opt.zero_grad(/*set_to_none=*/true);
      torch::mse_loss(model->forward(xs, true), ys).backward();
      opt.step();
      opt2.zero_grad(/*set_to_none=*/true);
      torch::mse_loss(model2->forward(xs, true), ys).backward();
      opt2.step();
      auto a = model->parameters(), b = model2->parameters();
      for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "after reload, param " << i;
    }
    // The scheduler acted on our groups (that the inner optimizer followed shows in the
    // parity above: its learning rate halves every step).
    if (c.scheduler) {
      for (size_t gi = 0; gi < opt.param_groups().size(); ++gi)
        EXPECT_EQ(opt.param_groups()[gi].options().get_lr(), ref_opt->param_groups()[gi].options().get_lr());
    }
  });
}

// A case is its name: '/'-separated words, each setting one field of Case (so a name
// cannot drift from what it runs): stage1 | stage2, all_reduce | reduce_scatter,
// sgd | adamw | cpu_adam, accum<k>, clip, overlap, lr (a StepLR scheduler),
// state_dict, bucket<elements>, one-bucket, zero_in_place, offload, auto (offload and
// gpu_margin_mem_ratio).
Case parse_case(const std::string& name) {
  Case c;
  c.name = name;
  size_t at = 0;
  while (at <= name.size()) {
    const size_t slash = std::min(name.find('/', at), name.size());
    const std::string w = name.substr(at, slash - at);
    at = slash + 1;
    auto number_after = [&](const std::string& prefix) { return std::stoll(w.substr(prefix.size())); };
    if (w == "stage1" || w == "stage2") c.stage = w == "stage1" ? 1 : 2;
    else if (w == "all_reduce") c.reduction = Stage1Reduction::kAllReduce;
    else if (w == "reduce_scatter") c.reduction = Stage1Reduction::kReduceScatter;
    else if (w == "sgd") c.opt = Opt::SGD;
    else if (w == "adamw") c.opt = Opt::AdamW;
    else if (w == "cpu_adam") c.opt = Opt::CPUAdam;
    else if (w.rfind("accum", 0) == 0) c.accum = static_cast<int>(number_after("accum"));
    else if (w == "clip") c.clip = 0.05;
    else if (w == "overlap") c.overlap = true;
    else if (w == "lr") c.scheduler = true;
    else if (w == "state_dict") c.state_dict = true;
    else if (w == "zero_in_place") c.zero_in_place = true;
    else if (w == "offload") c.offload = true;
    else if (w == "auto") c.offload = c.auto_placement = true;
    else if (w == "one-bucket") c.bucket = 1024 * 1024;
    else if (w.rfind("bucket", 0) == 0) c.bucket = number_after("bucket");
    else throw std::invalid_argument("parse_case: unknown word '" + w + "' in '" + name + "'");
  }
  return c;
}

// fp32 cases (check_case) at every N, and the bf16 ones (check_mixed_case).
const char* const kParityCases[] = {
    "stage1/all_reduce/sgd/state_dict",
    "stage1/all_reduce/adamw/accum2/clip/overlap/lr",
    "stage1/reduce_scatter/adamw/bucket64/clip",
    "stage1/reduce_scatter/sgd/accum2",
    "stage1/all_reduce/adamw/accum2/zero_in_place",
    "stage2/sgd/accum2/state_dict",
    "stage2/adamw/accum2/clip/overlap",
    "stage2/adamw/one-bucket/state_dict",
    "stage2/cpu_adam/bucket7/lr",
    // cpu_offload: the pieces step host copies; the same values.
    "stage1/all_reduce/adamw/accum2/offload/state_dict",
    "stage1/reduce_scatter/cpu_adam/bucket64/clip/offload/lr",
    "stage2/cpu_adam/bucket7/accum2/overlap/offload/state_dict",
    "stage2/adamw/bucket64/accum2/auto",
    "stage1/reduce_scatter/cpu_adam/bucket64/auto/state_dict",
};
const char* const kMixedCases[] = {
    "stage2/adamw/accum2",
    "stage1/all_reduce/adamw",
    "stage1/reduce_scatter/sgd/accum2",
    "stage2/cpu_adam/offload",
};

void check_mixed_case(comm::ProcessGroup& pg, const Case& c);

void parity_cases(comm::ProcessGroup& pg) {
  for (const char* name : kParityCases) check_case(pg, parse_case(name));
  for (const char* name : kMixedCases) check_mixed_case(pg, parse_case(name));
}

// Options and misuse are refused before anything changes, with the fix in the message.
void refusal_cases(comm::ProcessGroup& pg) {
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  run_case("refusals", [&] {
    auto model = make_net();
    auto adam = fsdp::optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3));
    expect_error([&] { ZeroRedundancyOptimizer(model->parameters(), adam, ZeroOptions()); }, "process_group");
    expect_error([&] { ZeroRedundancyOptimizer(model->parameters(), adam, ZeroOptions().process_group(pg).stage(3)); },
                 "stage must be 1");
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(model->parameters(), adam, ZeroOptions().process_group(pg).reduce_bucket_size(0));
        },
        "reduce_bucket_size");
    expect_error(
        [&] { ZeroRedundancyOptimizer(model->parameters(), adam, ZeroOptions().process_group(pg).sync_buffers(true)); },
        "module(model.ptr())");
    std::vector<torch::optim::OptimizerParamGroup> twice{torch::optim::OptimizerParamGroup(model->parameters()),
                                                         torch::optim::OptimizerParamGroup({model->fc1->weight})};
    expect_error(
        [&] { ZeroRedundancyOptimizer(twice, adam, ZeroOptions().process_group(pg).module(model.ptr())); },
        "'fc1.weight'");
    // LBFGS is caught once the inner optimizer exists (after the collective broadcast,
    // which every rank reaches alike).
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(model->parameters(),
                                  fsdp::optim::inner_optimizer<torch::optim::LBFGS>(torch::optim::LBFGSOptions(1)),
                                  ZeroOptions().process_group(pg));
        },
        "LBFGS cannot be sharded");
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(model->parameters(), adam, ZeroOptions().process_group(pg).gpu_margin_mem_ratio(0.5));
        },
        "add cpu_offload(true)");
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(model->parameters(), adam,
                                  ZeroOptions().process_group(pg).cpu_offload(true).gpu_margin_mem_ratio(1.5));
        },
        "gpu_margin_mem_ratio must be in [0, 1], got 1.5");
    // Offloading on one rank only: refused on every rank, naming what rank 0 passed.
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(model->parameters(), adam,
                                  ZeroOptions().process_group(pg).cpu_offload(pg.rank() == pg.size() - 1));
        },
        "rank 0 has 'cpu_offload(false)'");
  });
}

// Allocator-free accounting by tensor sizes: after a stage-2 AdamW step the gradients
// are gone, the optimizer state is two moments of this rank's pieces.
void memory_cases(comm::ProcessGroup& pg) {
  run_case("memory/stage2", [&] {
    auto model = make_net();
    ZeroRedundancyOptimizer opt(model->parameters(),
                                fsdp::optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)),
                                ZeroOptions().process_group(pg).stage(2).reduce_bucket_size(100));
    auto [x, y] = global_batch(0, kPerRank * pg.size());
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size()), true), rank_slice(y, pg.rank(), pg.size()))
        .backward();
    auto during = opt.get_memory_usage();
    EXPECT_EQ(during[MemoryCategory::kGradients], 4 * opt.partition_numel());
    opt.step();
    auto u = opt.get_memory_usage();
    int64_t frozen = 0;
    for (auto& p : model->parameters())
      if (!p.requires_grad()) frozen += p.numel();
    EXPECT_EQ(u[MemoryCategory::kParameterShards], 4 * (opt.flat_numel() + frozen));
    EXPECT_EQ(u[MemoryCategory::kGradients], 0);
    int64_t owned = 0;  // every trainable element was used: all pieces have state
    for (const auto& g : opt.inner().param_groups())
      for (const auto& p : g.params()) owned += p.numel();
    EXPECT_EQ(u[MemoryCategory::kOptimizerState], 8 * owned);
    EXPECT_LE(owned, opt.partition_numel());
    // Padding (< N per bucket) is all that separates the partition from the pieces.
    EXPECT_GE(owned, opt.partition_numel() - opt.num_buckets() * (pg.size() - 1));
    EXPECT_EQ(u.offloaded_bytes, 0);
  });
  // cpu_offload: the partition's host copy (masters), the optimizer state and the host copy
  // of the reduced gradients are the offloaded bytes; the device keeps the parameters and
  // the reduced partition until the step consumes it.
  run_case("memory/stage2/offload", [&] {
    auto model = make_net();
    ZeroRedundancyOptimizer opt(model->parameters(),
                                fsdp::optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)),
                                ZeroOptions().process_group(pg).stage(2).reduce_bucket_size(100).cpu_offload(true));
    const int64_t part = 4 * opt.partition_numel();
    auto before = opt.get_memory_usage();
    EXPECT_EQ(before[MemoryCategory::kMasterWeights], part);
    EXPECT_EQ(before.offloaded_bytes, part);
    auto [x, y] = global_batch(0, kPerRank * pg.size());
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size()), true), rank_slice(y, pg.rank(), pg.size()))
        .backward();
    opt.step();
    auto u = opt.get_memory_usage();
    int64_t owned = 0;
    for (const auto& g : opt.inner().param_groups())
      for (const auto& p : g.params()) owned += p.numel();
    EXPECT_EQ(u[MemoryCategory::kOptimizerState], 8 * owned);
    EXPECT_EQ(u[MemoryCategory::kGradients], part) << "only the host copy of the reduced partition is left";
    EXPECT_EQ(u.offloaded_bytes, part + 8 * owned + part);
    for (const auto& t : opt.local_pieces()) EXPECT_TRUE(t.tensor.device().is_cpu());
  });
}

// Mixed precision: bf16 parameters for compute, fp32 master partitions. The reference
// does the same casts in one process: a bf16 copy of the model computes every rank's
// gradients, which are reduced as the transport reduces them (stage 2: bf16 rows summed
// in rank order in bf16, / N, widened into the fp32 partition; stage 1 all-reduce: bf16
// summed in fp32 and rounded once, as comm::all_reduce does for bf16), an fp32 model
// steps, and its values rounded to bf16 are the next forward's. Bit-identical.
// mse_loss has no bf16 kernel on CPU.
torch::Tensor bf16_mse(const torch::Tensor& out, const torch::Tensor& target) { return (out - target).square().mean(); }

void check_mixed_case(comm::ProcessGroup& pg, const Case& c) {
  run_case("bf16/" + c.name, [&] {
    const int n = pg.size(), rank = pg.rank();
    const auto bf16 = torch::kBFloat16;
    auto master = make_net();
    auto compute = make_net();
    compute->to(bf16);
    auto ref_opt = make_reference_optimizer(c.opt, *master);
    auto model = make_net();
    ZeroRedundancyOptimizer opt(make_groups(c.opt, *model), make_factory(c.opt),
                                ZeroOptions()
                                    .process_group(pg)
                                    .stage(c.stage)
                                    .stage1_reduction(c.reduction)
                                    .reduce_bucket_size(c.bucket)
                                    .param_dtype(bf16)
                                    .cpu_offload(c.offload)
                                    .module(model.ptr()));
    for (auto& p : model->parameters()) ASSERT_EQ(p.scalar_type(), bf16);
    auto usage = opt.get_memory_usage();
    EXPECT_EQ(usage[MemoryCategory::kMasterWeights], 4 * opt.partition_numel());
    auto mp = master->parameters(), cp = compute->parameters();
    for (int s = 0; s < kSteps; ++s) {
      // Per rank and micro-batch gradients of the bf16 copy.
      std::vector<std::vector<std::vector<torch::Tensor>>> g(n, std::vector<std::vector<torch::Tensor>>(c.accum));
      for (int mb = 0; mb < c.accum; ++mb) {
        auto [x, y] = global_batch(10 * s + mb, kPerRank * n);
        for (int r = 0; r < n; ++r) {
          set_grads_to_none(*compute);
          bf16_mse(compute->forward(rank_slice(x, r, n).to(bf16), uses_branch(s, r, n)), rank_slice(y, r, n).to(bf16))
              .backward();
          for (auto& p : cp) g[r][mb].push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
        }
      }
      set_grads_to_none(*master);
      for (size_t i = 0; i < mp.size(); ++i) {
        if (!mp[i].requires_grad()) continue;
        torch::Tensor total;
        bool any = false;
        if (c.stage == 1) {
          std::vector<torch::Tensor> per_rank(n);
          for (int r = 0; r < n; ++r)
            for (int mb = 0; mb < c.accum; ++mb) {
              const auto& t = g[r][mb][i];
              if (!t.defined()) continue;
              any = true;
              per_rank[r] = per_rank[r].defined() ? per_rank[r] + t : t.clone();  // bf16 accumulation
            }
          if (c.reduction == Stage1Reduction::kAllReduce) {
            auto sum = torch::zeros_like(mp[i]);
            for (auto& t : per_rank)
              if (t.defined()) sum += t.to(torch::kFloat);
            total = (sum / n).to(bf16).to(torch::kFloat);
          } else {
            auto sum = torch::zeros_like(cp[i]);
            for (auto& t : per_rank)
              if (t.defined()) sum += t;
            total = (sum / n).to(torch::kFloat);
          }
        } else {
          for (int mb = 0; mb < c.accum; ++mb) {
            auto sum = torch::zeros_like(cp[i]);
            for (int r = 0; r < n; ++r)
              if (g[r][mb][i].defined()) {
                sum += g[r][mb][i];
                any = true;
              }
            auto wide = (sum / n).to(torch::kFloat);
            total = total.defined() ? total + wide : wide;
          }
        }
        if (any) mp[i].mutable_grad() = total;
      }
      ref_opt->step();
      {
        torch::NoGradGuard ng;
        for (size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i]);
      }

      opt.zero_grad(/*set_to_none=*/true);
      for (int mb = 0; mb < c.accum; ++mb) {
        auto [x, y] = global_batch(10 * s + mb, kPerRank * n);
        bf16_mse(model->forward(rank_slice(x, rank, n).to(bf16), uses_branch(s, rank, n)), rank_slice(y, rank, n).to(bf16))
            .backward();
      }
      opt.step();
      auto ours = model->parameters();
      for (size_t i = 0; i < cp.size(); ++i)
        EXPECT_TRUE(torch::equal(ours[i], cp[i])) << "step " << s << " param " << i << " rel "
                                                  << rel_diff(ours[i].to(torch::kFloat), cp[i].to(torch::kFloat));
    }
  });
}

// Loss scaling: backward(loss) scales by a power of two, step() unscales exactly, so a
// scaled run equals an unscaled one bit for bit. An inf in one element of one rank's
// gradient (only its owner sees it after the reduction) makes every rank skip:
// parameters and optimizer state unchanged, the scaler as DynamicGradScaler says.
void scaler_cases(comm::ProcessGroup& pg) {
  for (int stage : {1, 2}) {
    run_case("loss_scale/stage" + std::to_string(stage), [&] {
      const int n = pg.size(), rank = pg.rank();
      auto plain = make_net();
      auto scaled = make_net();
      auto options = [&](Net& m) {
        return ZeroOptions()
            .process_group(pg)
            .stage(stage)
            .stage1_reduction(Stage1Reduction::kReduceScatter)
            .reduce_bucket_size(100)
            .module(m.ptr());
      };
      ZeroRedundancyOptimizer a(make_groups(Opt::AdamW, *plain), make_factory(Opt::AdamW), options(plain));
      ZeroRedundancyOptimizer b(make_groups(Opt::AdamW, *scaled), make_factory(Opt::AdamW),
                                options(scaled).dynamic_loss_scale(ZeroOptions::low_level_zero_scaler()));
      precision::DynamicGradScaler expected(ZeroOptions::low_level_zero_scaler());
      EXPECT_EQ(b.loss_scale(), 65536.0);
      for (int s = 0; s < 5; ++s) {
        auto [x, y] = global_batch(s, kPerRank * n);
        auto xs = rank_slice(x, rank, n), ys = rank_slice(y, rank, n);
        const bool inf_step = s == 1 || s == 2;
        if (!inf_step) {
          a.zero_grad(/*set_to_none=*/true);
          a.backward(torch::mse_loss(plain->forward(xs, true), ys));
          a.step();
          EXPECT_TRUE(a.last_step_applied());
        }
        std::vector<torch::Tensor> before_params, before_state;
        for (auto& p : scaled->parameters()) before_params.push_back(p.detach().clone());
        for (const auto& kv : b.inner().state()) {
          auto& st = static_cast<torch::optim::AdamWParamState&>(*kv.second);
          before_state.push_back(st.exp_avg().clone());
          before_state.push_back(st.exp_avg_sq().clone());
        }
        b.zero_grad(/*set_to_none=*/true);
        auto loss = torch::mse_loss(scaled->forward(xs, true), ys);
        // One element of one rank's gradient: branch.bias[0] on rank s % n.
        if (inf_step && rank == s % n) loss = loss + scaled->branch->bias[0] * std::numeric_limits<float>::infinity();
        b.backward(loss);
        b.step();
        expected.update(inf_step);
        EXPECT_EQ(b.last_step_applied(), !inf_step) << "step " << s;
        EXPECT_EQ(b.loss_scale(), expected.scale()) << "step " << s;
        EXPECT_TRUE(b.loss_scaler_state() == expected.state()) << "step " << s;
        if (inf_step) {
          auto params = scaled->parameters();
          for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before_params[i]));
          size_t j = 0;
          for (const auto& kv : b.inner().state()) {
            auto& st = static_cast<torch::optim::AdamWParamState&>(*kv.second);
            EXPECT_TRUE(torch::equal(st.exp_avg(), before_state[j++]));
            EXPECT_TRUE(torch::equal(st.exp_avg_sq(), before_state[j++]));
          }
        } else {
          auto pa = plain->parameters(), pb = scaled->parameters();
          for (size_t i = 0; i < pa.size(); ++i)
            EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "step " << s << " rel " << rel_diff(pb[i], pa[i]);
        }
      }
      // Two overflows with hysteresis 2: the scale backed off once.
      EXPECT_EQ(b.loss_scale(), 32768.0);
    });
  }
}

// Buffers: broadcast from rank 0 at construction, and after every step with sync_buffers
// (BatchNorm running statistics, which per-rank batches make differ).
void buffer_cases(comm::ProcessGroup& pg) {
  run_case("sync_buffers", [&] {
    const int rank = pg.rank(), n = pg.size();
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(13, 8), torch::nn::BatchNorm1d(8), torch::nn::Linear(8, 5));
    auto bn = model[1]->as<torch::nn::BatchNorm1d>();
    {
      torch::NoGradGuard ng;
      bn->running_mean.add_(rank);  // differs per rank before construction
    }
    ZeroRedundancyOptimizer opt(model->parameters(),
                                fsdp::optim::inner_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
                                ZeroOptions().process_group(pg).stage(2).module(model.ptr()).sync_buffers(true));
    auto same_as_rank0 = [&](const torch::Tensor& t) {
      auto copy = t.detach().clone();
      comm::broadcast(pg, copy, 0).wait();
      return torch::equal(copy, t);
    };
    EXPECT_TRUE(same_as_rank0(bn->running_mean)) << "buffers not broadcast at construction";
    auto [x, y] = global_batch(0, kPerRank * n);
    torch::mse_loss(model->forward(rank_slice(x, rank, n)), rank_slice(y, rank, n)).backward();
    const bool same_before = same_as_rank0(bn->running_mean);  // collective: every rank calls it
    if (rank != 0) {
      EXPECT_FALSE(same_before) << "the test needs per-rank statistics";
    }
    opt.step();
    EXPECT_TRUE(same_as_rank0(bn->running_mean)) << "sync_buffers did not broadcast after the step";
    EXPECT_TRUE(same_as_rank0(bn->running_var));
  });
}

// ZeRO's accounting, counted by a wrapping CPU allocator at the peak of backward + step
// (not at rest), fp32 Adam, Ψ = 21,012,480 (80 Linear(512, 512)), N ranks:
//   stage 1 = 4Ψ (parameters) + 4Ψ (gradients) + 8Ψ/N (moments),
//   stage 2 = 4Ψ + 4Ψ/N (gradient partition) + 8Ψ/N.
// bf16 with fp32 masters and Adam (the variant that keeps reduced gradients in fp32,
// ZeroOptions::param_dtype says so):
//   stage 1 = 2Ψ (bf16 parameters) + 2Ψ (bf16 gradients) + 4Ψ/N (fp32 reduced partition)
//             + 12Ψ/N (masters and moments),
//   stage 2 = 2Ψ + 4Ψ/N (fp32 gradient partition) + 12Ψ/N.
// Buckets of 64K elements, a batch of 2: buckets, one layer's gradient in flight,
// Adam's per-piece temporaries and activations stay near 1% of the total.
void peak_memory_cases(comm::ProcessGroup& pg) {
  auto* counter = install_counting_allocator();
  const int n = pg.size();
  for (bool bf16 : {false, true})
  for (int stage : {1, 2}) {
    run_case(std::string(bf16 ? "peak/bf16/stage" : "peak/stage") + std::to_string(stage), [&] {
      const int64_t base = counter->live();
      torch::manual_seed(0);
      torch::nn::Sequential model;
      for (int i = 0; i < 80; ++i) model->push_back(torch::nn::Linear(512, 512));
      int64_t psi = 0;
      for (auto& p : model->parameters()) psi += p.numel();
      ZeroRedundancyOptimizer opt(model->parameters(),
                                  fsdp::optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-4)),
                                  ZeroOptions().process_group(pg).stage(stage).reduce_bucket_size(64 * 1024).param_dtype(
                                      bf16 ? c10::optional<at::ScalarType>(at::kBFloat16) : c10::nullopt));
      auto x = torch::randn({2, 512}, bf16 ? at::kBFloat16 : at::kFloat);
      auto train_step = [&] {
        opt.zero_grad(/*set_to_none=*/true);
        model->forward(x).square().mean().backward();
        opt.step();
      };
      train_step();  // the moments exist from here on
      counter->reset_peak();
      train_step();
      const double peak = static_cast<double>(counter->peak() - base);
      const double expected = bf16 ? (stage == 1 ? 4.0 * psi + 16.0 * psi / n : 2.0 * psi + 16.0 * psi / n)
                                   : (stage == 1 ? 8.0 * psi + 8.0 * psi / n : 4.0 * psi + 12.0 * psi / n);
      EXPECT_NEAR(peak, expected, 0.05 * expected)
          << "stage " << stage << " peak " << peak << " B, ZeRO accounting " << expected << " B (Ψ=" << psi
          << ", N=" << n << ")";
      // The optimizer's own accounting at the same moment of the next step's backward end.
      opt.zero_grad(/*set_to_none=*/true);
      model->forward(x).square().mean().backward();
      auto u = opt.get_memory_usage();
      const double reported = static_cast<double>(u.total());
      const double live = static_cast<double>(counter->live() - base - static_cast<int64_t>(x.nbytes()));
      EXPECT_NEAR(reported, live, 0.03 * live) << "get_memory_usage " << reported << " vs allocator " << live;
      opt.step();
      // The freed bucket buffers kept for the next step (reported as "other") are what
      // empty_cache() hands back to the allocator, byte for byte.
      opt.zero_grad(/*set_to_none=*/true);
      auto kept = opt.get_memory_usage();
      const int64_t other = kept[fsdp::MemoryCategory::kOther];
      EXPECT_GT(other, 0) << "no freed bucket buffer kept after the step";
      // A bucket holds at least one parameter: here a 512x512 weight, above the 64K cap.
      const int64_t largest_bucket = int64_t(512) * 512 * (bf16 ? 2 : 4);
      EXPECT_LE(other, 4 * (largest_bucket + 4096)) << "more than four buckets kept";
      const int64_t before = counter->live();
      opt.empty_cache();
      EXPECT_EQ(before - counter->live(), other) << "empty_cache released other than get_memory_usage reported";
      auto after = opt.get_memory_usage();
      EXPECT_EQ(after[fsdp::MemoryCategory::kOther], 0);
      std::printf("[zero memory] %s stage %d N=%d: peak %.1f MB, accounting %.1f MB (%+.2f%%)\n",
                  bf16 ? "bf16" : "fp32", stage, n, peak / 1e6,
                  expected / 1e6, 100.0 * (peak - expected) / expected);
    });
  }
}

}  // namespace

// Pieces of every rank tile every parameter exactly once; ranks own equal chunks; a
// bucket closes before the parameter that would take it past the cap.
TEST(ZeroLayout, PiecesTileEveryParameterOnce) {
  using fsdp::optim::detail::ZeroLayout;
  const std::vector<int64_t> numels{5, 403, 31, 0, 527, 17, 85, 5, 1};
  for (int n = 1; n <= 4; ++n) {
    for (int64_t cap : {int64_t{1}, int64_t{7}, int64_t{100}, int64_t{1} << 20}) {
      ZeroLayout layout(numels, n, cap);
      std::vector<std::vector<int>> covered(numels.size());
      for (size_t i = 0; i < numels.size(); ++i) covered[i].assign(numels[i], 0);
      for (int r = 0; r < n; ++r) {
        int64_t local = 0;
        for (const auto& pc : layout.pieces(r)) {
          EXPECT_GE(pc.local_offset, local);
          local = pc.local_offset + pc.numel;
          EXPECT_LE(local, layout.partition_numel());
          for (int64_t e = 0; e < pc.numel; ++e) covered[pc.param][pc.param_offset + e] += 1;
          EXPECT_EQ(pc.flat_offset, layout.params()[pc.param].flat_offset + pc.param_offset);
        }
      }
      for (size_t i = 0; i < numels.size(); ++i)
        for (int v : covered[i]) ASSERT_EQ(v, 1) << "n=" << n << " cap=" << cap << " param " << i;
      int64_t flat = 0, part = 0;
      for (const auto& b : layout.buckets()) {
        EXPECT_EQ(b.flat_offset, flat);
        EXPECT_EQ(b.padded % n, 0);
        EXPECT_LT(b.padded - b.numel, n);
        EXPECT_TRUE(b.numel <= cap || b.end_param - b.first_param == 1) << "over the cap";
        if (b.end_param < static_cast<int>(numels.size())) {
          EXPECT_GT(b.numel + numels[b.end_param], cap) << "closed too early";
        }
        flat += b.padded;
        part += b.chunk;
      }
      EXPECT_EQ(layout.flat_numel(), flat);
      EXPECT_EQ(layout.partition_numel(), part);
    }
  }
}

TEST(ZeroPlacement, BucketsInFlatOrderWhileTheyFit) {
  using fsdp::engine::device_pieces;
  using fsdp::engine::margin_budget;
  EXPECT_EQ(device_pieces({5, 3, 8, 2}, 9), (std::vector<uint8_t>{1, 1, 0, 0}));
  EXPECT_EQ(device_pieces({5, 3, 8, 2}, 10), (std::vector<uint8_t>{1, 1, 0, 1}));
  EXPECT_EQ(device_pieces({5, 3}, 0), (std::vector<uint8_t>{0, 0}));
  EXPECT_EQ(margin_budget({1000, 200}, 0.5), 400);
  EXPECT_EQ(margin_budget({1000, 1200}, 1.0), 0) << "a peak above the capacity leaves no margin";
}

TEST(ZeroOptimizer, ParityWithSingleProcess) {
  for (int n = 1; n <= 3; ++n)
    run_ranks(n, [](comm::ProcessGroup& pg) {
      parity_cases(pg);
      if (pg.size() == 2) {
        refusal_cases(pg);
        memory_cases(pg);
        buffer_cases(pg);
      }
      if (pg.size() >= 2) scaler_cases(pg);
    });
  // N=4: one exact case per stage (every bucket padded, buckets cutting parameters).
  run_ranks(4, [](comm::ProcessGroup& pg) {
    for (const char* name : {"stage1/reduce_scatter/sgd/accum2", "stage2/cpu_adam/bucket7/lr"})
      check_case(pg, parse_case(name));
  });
}

// Checkpoint directories shared with FSDP (fsdp/state/zero_checkpoint.h): a chain of
// saves and loads through both families and four world sizes, each continuing the
// training of one uninterrupted run:
//   ZeRO-2 at N=2 saves at step 3 (and continues to step 6: the reference; reloaded at
//   N=2 into a fresh model, the continuation is bitwise equal);
//   -> FSDP FULL_SHARD at N=4 loads it, saves, continues;
//   -> ZeRO-1 at N=3 loads that, saves, continues;
//   -> FSDP NO_SHARD at N=1 loads that, continues.
// Adam (moments and per-parameter steps must carry over). Across world sizes only the
// order of float sums changes: within 1e-5 relative L2 of the reference.
namespace xckpt {

constexpr int64_t kBatch = 12;  // divisible by 1..4
constexpr int64_t kSave = 3, kEnd = 6;

torch::optim::AdamOptions adam() { return torch::optim::AdamOptions(1e-2); }

template <typename Forward, typename Step>
void train(const comm::ProcessGroup& pg, Forward forward, Step step, int64_t from, int64_t to) {
  for (int64_t s = from; s < to; ++s) {
    auto [x, y] = global_batch(s, kBatch);
    torch::mse_loss(forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())).backward();
    step();
  }
}

std::unique_ptr<ZeroRedundancyOptimizer> zero(comm::ProcessGroup& pg, TinyTransformer& m, int stage) {
  return std::make_unique<ZeroRedundancyOptimizer>(
      m->parameters(), fsdp::optim::inner_optimizer<torch::optim::Adam>(adam()),
      ZeroOptions().process_group(pg).stage(stage).reduce_bucket_size(100).module(m.ptr()));
}
void train_zero(comm::ProcessGroup& pg, TinyTransformer& m, ZeroRedundancyOptimizer& opt, int64_t from, int64_t to) {
  train(pg, [&](const torch::Tensor& x) { return m->forward(x); }, [&] { opt.step(); opt.zero_grad(/*set_to_none=*/true); }, from, to);
}
using Fsdp = FullyShardedDataParallel<TinyTransformerImpl>;
void train_fsdp(comm::ProcessGroup& pg, Fsdp& m, torch::optim::Optimizer& opt, int64_t from, int64_t to) {
  train(pg, [&](const torch::Tensor& x) { return m->forward(x); }, [&] { opt.step(); opt.zero_grad(/*set_to_none=*/false); }, from, to);
}

std::map<std::string, torch::Tensor> params_of(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}
void save_reference(const std::map<std::string, torch::Tensor>& p) {
  std::vector<torch::Tensor> v;
  for (const auto& kv : p) v.push_back(kv.second);
  torch::save(v, test_dir() + "/reference.pt");
}
void expect_reference(const std::map<std::string, torch::Tensor>& got, const std::string& where) {
  std::vector<torch::Tensor> v;
  torch::load(v, test_dir() + "/reference.pt");
  ASSERT_EQ(v.size(), got.size()) << where;
  size_t i = 0;
  for (const auto& kv : got) EXPECT_LT(rel_diff(kv.second, v[i++]), 1e-5) << where << ": " << kv.first;
}

}  // namespace xckpt

TEST(ZeroOptimizer, CheckpointsCrossFsdpAndWorldSizes) {
  using namespace xckpt;
  const std::string dir = test_dir();
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    run_case("zero2 N=2: save, continue, reload bitwise", [&] {
      auto m = make_transformer(0);
      auto opt = zero(pg, m, 2);
      train_zero(pg, m, *opt, 0, kSave);
      CheckpointExtra extra;
      extra.values["step"] = std::to_string(kSave);
      save_checkpoint(dir + "/zero2-n2", *opt, extra);
      train_zero(pg, m, *opt, kSave, kEnd);
      const auto reference = params_of(*m);
      if (pg.rank() == 0) save_reference(reference);
      auto m2 = make_transformer(7);
      auto opt2 = zero(pg, m2, 2);
      EXPECT_EQ(load_checkpoint(dir + "/zero2-n2", *opt2).values.at("step"), "3");
      train_zero(pg, m2, *opt2, kSave, kEnd);
      for (const auto& kv : params_of(*m2))
        EXPECT_TRUE(torch::equal(kv.second, reference.at(kv.first))) << kv.first << " differs after reload at N=2";
      comm::barrier(pg);
    });
  }, rank_options());
  run_ranks(4, [&](comm::ProcessGroup& pg) {
    run_case("FULL_SHARD N=4 <- zero2 N=2", [&] {
      Fsdp m(make_transformer(7), pg, Options().auto_wrap_policy(always_wrap_policy()));
      torch::optim::Adam opt(m->parameters(), adam());
      load_checkpoint(dir + "/zero2-n2", *m, &opt);
      save_checkpoint(dir + "/full-n4", *m, &opt);
      train_fsdp(pg, m, opt, kSave, kEnd);
      expect_reference(full_params(m), "FULL_SHARD at N=4 from zero2 at N=2");
    });
  }, rank_options());
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    run_case("zero1 N=3 <- FULL_SHARD N=4", [&] {
      auto m = make_transformer(7);
      auto opt = zero(pg, m, 1);
      load_checkpoint(dir + "/full-n4", *opt);
      save_checkpoint(dir + "/zero1-n3", *opt);
      train_zero(pg, m, *opt, kSave, kEnd);
      expect_reference(params_of(*m), "zero1 at N=3 from FULL_SHARD at N=4");
    });
  }, rank_options());
  run_ranks(1, [&](comm::ProcessGroup& pg) {
    run_case("NO_SHARD N=1 <- zero1 N=3", [&] {
      Fsdp m(make_transformer(7), pg, Options().sharding_strategy(ShardingStrategy::kNoShard));
      torch::optim::Adam opt(m->parameters(), adam());
      load_checkpoint(dir + "/zero1-n3", *m, &opt);
      train_fsdp(pg, m, opt, kSave, kEnd);
      expect_reference(full_params(m), "NO_SHARD at N=1 from zero1 at N=3");
    });
  }, rank_options());
}

TEST(ZeroOptimizer, PeakModelStateMemory) {
  for (int n : {2, 3}) run_ranks(n, peak_memory_cases);
}

// One loop for both families (fsdp/trainer/training_facade.h): the same function trains
// a ZeRO-2 optimizer on the unwrapped MLP and FSDP NO_SHARD + Adam on a wrapped copy,
// LowLevelZero's scaler on both, with an inf injected into one rank's loss at steps 1
// and 2: both skip those steps on every rank and back off once (hysteresis 2), and
// their parameters stay equal to each other after every step and to an unscaled FSDP
// run without the facade that simply leaves out the inf steps (power-of-two scales
// unscale exactly). Checked bitwise: ZeRO-2's reduce-scatter and NO_SHARD's all-reduce
// both sum in rank order and divide by N.
TEST(ZeroOptimizer, FacadeDrivesZeroAndFsdpAlike) {
  using fsdp::trainer::FacadeOptions;
  using fsdp::trainer::TrainingFacade;
  run_ranks(2, [](comm::ProcessGroup& pg) {
    run_case("facade", [&] {
      const int n = pg.size(), rank = pg.rank();
      auto scaler = ZeroOptions::low_level_zero_scaler();
      auto adam = torch::optim::AdamOptions(1e-2);
      auto unwrapped = make_mlp(0);
      ZeroRedundancyOptimizer zopt(unwrapped->parameters(), fsdp::optim::inner_optimizer<torch::optim::Adam>(adam),
                                   ZeroOptions().process_group(pg).stage(2).reduce_bucket_size(100)
                                       .module(unwrapped.ptr()).dynamic_loss_scale(scaler));
      auto wrapped = FullyShardedDataParallel(make_mlp(0), pg, Options().sharding_strategy(ShardingStrategy::kNoShard));
      torch::optim::Adam fopt(wrapped->parameters(), adam);
      auto plain = FullyShardedDataParallel(make_mlp(0), pg, Options().sharding_strategy(ShardingStrategy::kNoShard));
      torch::optim::Adam popt(plain->parameters(), adam);
      TrainingFacade zero(zopt);
      TrainingFacade fsdp_loop(*wrapped, fopt, FacadeOptions().dynamic_loss_scale(scaler));
      // The one loop both families share.
      auto train_step = [&](TrainingFacade& t, const std::function<torch::Tensor(const torch::Tensor&)>& fwd,
                            int s) {
        auto [x, y] = global_batch(s, kPerRank * n);
        auto out = fwd(rank_slice(x, rank, n));
        auto loss = torch::mse_loss(out, rank_slice(y, rank, n));
        // One element of one rank's gradients becomes inf: the output's first entry.
        if ((s == 1 || s == 2) && rank == s % n) loss = loss + out.view({-1})[0] * std::numeric_limits<float>::infinity();
        t.zero_grad(/*set_to_none=*/true);
        t.backward(loss);
        return t.step();
      };
      precision::DynamicGradScaler expected(scaler);
      for (int s = 0; s < 5; ++s) {
        const bool inf_step = s == 1 || s == 2;
        EXPECT_EQ(train_step(zero, [&](const torch::Tensor& x) { return unwrapped->forward(x); }, s), !inf_step);
        EXPECT_EQ(train_step(fsdp_loop, [&](const torch::Tensor& x) { return wrapped->forward(x); }, s), !inf_step);
        if (!inf_step) {
          auto [x, y] = global_batch(s, kPerRank * n);
          popt.zero_grad(/*set_to_none=*/false);
          torch::mse_loss(plain->forward(rank_slice(x, rank, n)), rank_slice(y, rank, n)).backward();
          popt.step();
        }
        expected.update(inf_step);
        EXPECT_EQ(zero.loss_scale(), expected.scale()) << "step " << s;
        EXPECT_EQ(fsdp_loop.loss_scale(), expected.scale()) << "step " << s;
        auto a = full_params(wrapped), b = full_params(plain);
        for (const auto& p : unwrapped->named_parameters()) {
          EXPECT_TRUE(torch::equal(p.value(), a.at(p.key()))) << "step " << s << " " << p.key() << " ZeRO vs FSDP, rel "
                                                              << rel_diff(p.value(), a.at(p.key()));
          EXPECT_TRUE(torch::equal(b.at(p.key()), a.at(p.key()))) << "step " << s << " " << p.key()
                                                                  << " FSDP facade vs plain";
        }
      }
      EXPECT_EQ(zero.loss_scale(), 32768.0);  // two overflows, hysteresis 2: backed off once
    });
  });
}
