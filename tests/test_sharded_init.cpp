// Sharded construction (ShardedInitContext, include/fsdp/core/sharded_init.h) at N=2,
// fsdp-train's 16-block gpt at N=2 and 4, and the rank-0 pretrained load
// (include/fsdp/state/rank0_load.h).
// References: the same model constructed eagerly from the same seed (values bit
// for bit), the same model constructed eagerly and wrapped (unit layout, and
// every training step bit for bit: both hold the same shards and run the same
// schedule), and for memory the closed form shards + largest unit x (1 + 1/N) +
// parameters outside units, counted by a wrapping CPU allocator.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "core/counting_allocator.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/memory_estimate.h"
#include "fsdp/core/sharded_init.h"
#include "fsdp/state/rank0_load.h"
#include "fsdp/state/state_dict.h"
#include "harness/error_of.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/temp_dir.h"
#include "models.h"  // fsdp-train's gpt (tools/fsdp_train)

using namespace fsdp;
using fsdp::testing::BlockImpl;
using fsdp::testing::run_case;
using fsdp::testing::run_ranks;
using fsdp::testing::TinyTransformer;
using fsdp::testing::TinyTransformerImpl;

using fsdp::testing::error_of;

namespace {

std::map<std::string, torch::Tensor> snapshot(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

void expect_bitwise_equal(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    EXPECT_TRUE(t.sizes() == it->second.sizes() && torch::equal(t, it->second)) << name;
  }
}

std::shared_ptr<TinyTransformerImpl> build_sharded(comm::ProcessGroup& pg, const Options& o, uint64_t seed,
                                                   int64_t dim = 24, int layers = 3, int64_t* units = nullptr) {
  ShardedInitContext ctx(pg, o);
  torch::manual_seed(seed);
  auto m = std::make_shared<TinyTransformerImpl>(13, dim, 5, layers);
  if (units) *units = ctx.units_sharded();
  return m;
}

std::shared_ptr<TinyTransformerImpl> build_eager(uint64_t seed, int64_t dim = 24, int layers = 3) {
  torch::manual_seed(seed);
  return std::make_shared<TinyTransformerImpl>(13, dim, 5, layers);
}

struct Config {
  std::string name;
  Options options;
  int64_t units_at_construction;  // of the 3-block model
};

std::vector<Config> configs() {
  return {
      // Block and its two Sequential Linear entries, per block.
      {"always_wrap full_shard", Options().auto_wrap_policy(always_wrap_policy()), 9},
      // One unit per block; rank 0's values broadcast unit by unit.
      {"block type shard_grad_op sync", Options()
                                            .auto_wrap_policy(module_type_policy<BlockImpl>())
                                            .sharding_strategy(ShardingStrategy::kShardGradOp)
                                            .sync_module_states(true),
       3},
      // Only the Sequential entries (1,225 and 1,200 elements) inside each block
      // are units; the block itself (648 left) is not; bf16 compute.
      {"size 1000 bf16", Options().auto_wrap_policy(size_based_policy(1000)).mixed_precision(
                             MixedPrecision().param_dtype(torch::kBFloat16)), 6},
  };
}

// Parent constructors that touch sharded children.
struct InitInParentImpl : torch::nn::Module {
  InitInParentImpl() {
    block = register_module("block", Wrappable<BlockImpl>(8));
    width = block->mix->weight.size(1);  // full shapes stay queryable
    apply([](torch::nn::Module& m) {
      if (auto* l = m.as<torch::nn::Linear>()) torch::nn::init::normal_(l->weight);
    });
  }
  Wrappable<BlockImpl> block{nullptr};
  int64_t width = 0;
};

struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  torch::Tensor weight;
};

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    block = register_module("block", Wrappable<BlockImpl>(8));
    head = register_module("head", std::make_shared<TiedHeadImpl>(block->mix->weight));
  }
  torch::Tensor forward(torch::Tensor x) { return block->forward(x); }
  Wrappable<BlockImpl> block{nullptr};
  std::shared_ptr<TiedHeadImpl> head;
};

struct WarningCollector : c10::WarningHandler {
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

void sharded_init_cases(comm::ProcessGroup& pg) {
  for (const auto& cfg : configs()) {
    run_case("initial values and steps, " + cfg.name, [&] {
      const auto reference = snapshot(*build_eager(7));
      const auto after_eager = torch::rand({4});
      int64_t units = 0;
      auto sharded = build_sharded(pg, cfg.options, 7, 24, 3, &units);
      // Every rank drew the same random stream as eager construction.
      EXPECT_TRUE(torch::equal(torch::rand({4}), after_eager));
      EXPECT_EQ(units, cfg.units_at_construction);
      // Placeholders keep their full shapes; parameters outside units are untouched.
      if (cfg.units_at_construction != 6) {
        EXPECT_TRUE(is_sharded_placeholder(sharded->blocks[0]->mix->weight));
        EXPECT_EQ(sharded->blocks[0]->mix->weight.sizes().vec(), std::vector<int64_t>({24, 24}));
      }
      EXPECT_TRUE(is_sharded_placeholder(sharded->blocks[2]->mlp[0]->as<torch::nn::Linear>()->weight));
      EXPECT_FALSE(is_sharded_placeholder(sharded->proj->weight));

      auto zero = FullyShardedDataParallel(sharded, pg, cfg.options);
      auto eager = FullyShardedDataParallel(build_eager(7), pg, cfg.options);
      EXPECT_EQ(zero->unit_paths(), eager->unit_paths());
      EXPECT_FALSE(is_sharded_placeholder(sharded->blocks[0]->mix->weight));
      expect_bitwise_equal(fsdp::testing::full_params(zero), reference);

      // Step by step: same loss and same parameters as the eagerly constructed model.
      torch::optim::Adam opt_zero(zero->parameters(), 1e-2), opt_eager(eager->parameters(), 1e-2);
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = fsdp::testing::global_batch(step, 8);
        x = fsdp::testing::rank_slice(x, pg.rank(), pg.size());
        y = fsdp::testing::rank_slice(y, pg.rank(), pg.size());
        opt_zero.zero_grad(/*set_to_none=*/false);
        opt_eager.zero_grad(/*set_to_none=*/false);
        auto loss_zero = torch::mse_loss(zero->forward(x).to(torch::kFloat), y);
        auto loss_eager = torch::mse_loss(eager->forward(x).to(torch::kFloat), y);
        EXPECT_TRUE(torch::equal(loss_zero, loss_eager)) << "step " << step;
        loss_zero.backward();
        loss_eager.backward();
        opt_zero.step();
        opt_eager.step();
      }
      expect_bitwise_equal(fsdp::testing::full_params(zero), fsdp::testing::full_params(eager));
    });
  }

  run_case("param_init_fn", [&] {
    // Deterministic (no random draws), so eager and sharded construction agree.
    auto init = [](torch::nn::Module& m) {
      if (auto* l = m.as<torch::nn::Linear>()) {
        l->weight.copy_(torch::arange(l->weight.numel(), torch::kFloat).reshape(l->weight.sizes()) * 1e-3);
        l->bias.fill_(0.5);
      }
    };
    auto o = Options().auto_wrap_policy(always_wrap_policy()).param_init_fn(init);
    auto zero = FullyShardedDataParallel(build_sharded(pg, o, 3), pg, o);
    auto eager = FullyShardedDataParallel(build_eager(3), pg, o);
    const auto z = fsdp::testing::full_params(zero);
    expect_bitwise_equal(z, fsdp::testing::full_params(eager));
    // Closed form: inside a unit sharded at construction, and outside units.
    EXPECT_TRUE(torch::equal(z.at("block1.mix.weight"), torch::arange(576, torch::kFloat).reshape({24, 24}) * 1e-3));
    EXPECT_TRUE(torch::equal(z.at("head.bias"), torch::full({5}, 0.5)));
    // LayerNorm is not a Linear: its default initialisation stays.
    EXPECT_TRUE(torch::equal(z.at("block0.norm.weight"), torch::ones({24})));
  });

  run_case("touching a sharded parameter fails naming it", [&] {
    const auto o = Options().auto_wrap_policy(always_wrap_policy());
    {
      ShardedInitContext ctx(pg, o);
      const std::string err = error_of([] { InitInParentImpl m; });
      EXPECT_NE(err.find("'mix.weight'"), std::string::npos) << err;
      EXPECT_NE(err.find("param_init_fn"), std::string::npos) << err;
      EXPECT_NE(err.find("normal_"), std::string::npos) << err;
    }
    std::shared_ptr<TinyTransformerImpl> m = build_sharded(pg, o, 1);
    const std::string err = error_of([&] {
      torch::NoGradGuard no_grad;
      m->blocks[1]->mix->bias.mul_(2);
    });
    EXPECT_NE(err.find("'mix.bias'"), std::string::npos) << err;
    EXPECT_EQ(m->blocks[1]->mix->bias.numel(), 24);
  });

  run_case("refusals", [&] {
    const auto o = Options().auto_wrap_policy(always_wrap_policy());
    std::string err = error_of([&] { ShardedInitContext ctx(pg, Options().auto_wrap_policy(path_policy({"block0"}))); });
    EXPECT_NE(err.find("path_policy"), std::string::npos) << err;
    err = error_of([&] { ShardedInitContext ctx(pg, Options()); });
    EXPECT_NE(err.find("auto_wrap_policy"), std::string::npos) << err;
    err = error_of([&] {
      ShardedInitContext a(pg, o);
      ShardedInitContext b(pg, o);
    });
    EXPECT_NE(err.find("already alive"), std::string::npos) << err;

    // Other options at adoption: another layout, or a policy that drops units.
    err = error_of([&] {
      auto w = FullyShardedDataParallel(build_sharded(pg, o, 1), pg,
                               Options().auto_wrap_policy(always_wrap_policy()).sharding_strategy(
                                   ShardingStrategy::kNoShard));
    });
    EXPECT_NE(err.find("sharded at construction"), std::string::npos) << err;
    EXPECT_NE(err.find("NO_SHARD"), std::string::npos) << err;
    err = error_of([&] {
      auto w = FullyShardedDataParallel(build_sharded(pg, o, 1), pg, Options().auto_wrap_policy(module_type_policy<BlockImpl>()));
    });
    EXPECT_NE(err.find("does not make it a unit"), std::string::npos) << err;
    EXPECT_NE(err.find(".mlp."), std::string::npos) << err;

    // A tie across units, made by a parent after its child was sharded.
    std::shared_ptr<TiedImpl> tied;
    {
      ShardedInitContext ctx(pg, o);
      tied = std::make_shared<TiedImpl>();
    }
    err = error_of([&] { auto w = FullyShardedDataParallel(tied, pg, o); });
    EXPECT_NE(err.find("'head.weight'"), std::string::npos) << err;
    EXPECT_NE(err.find("'block.mix.weight'"), std::string::npos) << err;

    // Sequential entries are invisible to the context: it warns.
    WarningCollector warnings;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      ShardedInitContext ctx(pg, o);
      auto mlp = fsdp::testing::make_mlp();
    }
    EXPECT_TRUE(std::any_of(warnings.messages.begin(), warnings.messages.end(), [](const std::string& m) {
      return m.find("without sharding anything") != std::string::npos;
    })) << warnings.messages.size() << " warnings";
  });

  run_case("construction peak", [&] {
    auto* counter = memory::install_counting_allocator();
    const int n = pg.size();
    const int64_t dim = 256;
    const int layers = 8;
    const auto o = Options().auto_wrap_policy(module_type_policy<BlockImpl>());

    int64_t base = counter->live();
    counter->reset_peak();
    int64_t unit_numel = 0, outside_numel = 0;
    {
      auto eager = build_eager(0, dim, layers);
      for (const auto& p : eager->named_parameters()) {
        if (p.key().rfind("block0.", 0) == 0) unit_numel += p.value().numel();
        if (p.key().rfind("block", 0) != 0) outside_numel += p.value().numel();
      }
    }
    const int64_t eager_peak = counter->peak() - base;

    base = counter->live();
    counter->reset_peak();
    auto sharded = build_sharded(pg, o, 0, dim, layers);
    const int64_t zero_peak = counter->peak() - base;
    const int64_t chunk_bytes = comm::padded_numel(unit_numel, n) / n * 4;
    const int64_t shards = layers * chunk_bytes;
    const int64_t bound = shards + unit_numel * 4 + chunk_bytes + outside_numel * 4;
    std::cout << "[rank " << pg.rank() << "] construction peak: eager " << eager_peak << " B, sharded " << zero_peak
              << " B, bound " << bound << " B (+5%), shards " << shards << " B, unit " << unit_numel * 4
              << " B, outside units " << outside_numel * 4 << " B" << std::endl;
    EXPECT_LE(zero_peak, bound * 105 / 100);
    EXPECT_GE(eager_peak, (layers * unit_numel + outside_numel) * 4);

    // Adoption keeps the shards: no second copy of any unit.
    auto model = FullyShardedDataParallel(sharded, pg, o);
    const int64_t after_wrap = counter->live() - base;
    const int64_t root_chunk = comm::padded_numel(outside_numel, n) / n * 4;
    std::cout << "[rank " << pg.rank() << "] after wrapping: " << after_wrap << " B (shards + root shard "
              << shards + root_chunk << " B)" << std::endl;
    EXPECT_LE(after_wrap, (shards + root_chunk) * 105 / 100);
  });
}

using train::GptBlockImpl;
using train::GptConfig;
using train::GptImpl;

std::shared_ptr<GptImpl> build_gpt(const GptConfig& cfg, uint64_t seed, comm::ProcessGroup* pg = nullptr,
                                   const Options* o = nullptr) {
  std::unique_ptr<ShardedInitContext> ctx;
  if (pg) ctx = std::make_unique<ShardedInitContext>(*pg, *o);
  torch::manual_seed(seed);
  return std::make_shared<GptImpl>(cfg);
}

// Next-byte batch for step s: this rank's 2 of 2N sequences.
std::pair<torch::Tensor, torch::Tensor> gpt_batch(int64_t step, const GptConfig& cfg, int rank, int world) {
  auto gen = at::detail::createCPUGenerator(500 + step);
  auto seq = at::randint(cfg.vocab, {2 * world, 17}, gen, torch::kLong);
  seq = fsdp::testing::rank_slice(seq, rank, world);
  return {seq.slice(1, 0, 16), seq.slice(1, 1, 17)};
}

// The sharded-construction bound (memory_estimate.h), at N=2 and 4, for fsdp-train's gpt with 16 blocks: the
// allocator-counted construction peak <= shards + largest unit x (1 + 1/N) +
// parameters outside units, +5%; then identical initial values and losses.
void gpt16_cases(comm::ProcessGroup& pg) {
  run_case("16-block gpt: construction peak, values, losses", [&] {
    auto* counter = memory::install_counting_allocator();
    const int n = pg.size();
    const GptConfig cfg{/*vocab=*/256, /*layers=*/16, /*dim=*/128, /*heads=*/4, /*context=*/16};
    const auto o = Options().auto_wrap_policy(module_type_policy<GptBlockImpl>());

    int64_t base = counter->live();
    counter->reset_peak();
    int64_t unit_numel = 0, outside_numel = 0;
    {
      auto eager = build_gpt(cfg, 0);
      for (const auto& p : eager->named_parameters()) {
        if (p.key().rfind("block0.", 0) == 0) unit_numel += p.value().numel();
        if (p.key().rfind("block", 0) != 0) outside_numel += p.value().numel();
      }
    }
    const int64_t eager_peak = counter->peak() - base;

    base = counter->live();
    counter->reset_peak();
    auto sharded = build_gpt(cfg, 0, &pg, &o);
    const int64_t zero_peak = counter->peak() - base;
    const int64_t chunk_bytes = comm::padded_numel(unit_numel, n) / n * 4;
    const int64_t shards = cfg.layers * chunk_bytes;
    const int64_t bound = shards + unit_numel * 4 + chunk_bytes + outside_numel * 4;
    std::cout << "[rank " << pg.rank() << " of " << n << "] 16-block gpt construction peak: eager " << eager_peak
              << " B, sharded " << zero_peak << " B, bound " << bound << " B (+5%: " << bound * 105 / 100
              << "), shards " << shards << " B, unit " << unit_numel * 4 << " B, outside units "
              << outside_numel * 4 << " B" << std::endl;
    EXPECT_LE(zero_peak, bound * 105 / 100);
    EXPECT_GE(eager_peak, (cfg.layers * unit_numel + outside_numel) * 4);
    // fsdp::estimate_construction (what fsdp-train --estimate-memory prints) is this
    // bound without counting the last unit's shard twice (it is one of the shards).
    const auto estimate = estimate_construction(std::vector<int64_t>(cfg.layers, unit_numel), outside_numel, n);
    EXPECT_EQ(int64_t(estimate.sharded_peak), bound - chunk_bytes);
    EXPECT_LE(zero_peak, int64_t(estimate.sharded_peak) * 105 / 100);
    EXPECT_LE(eager_peak, int64_t(estimate.eager_peak));

    auto zero = FullyShardedDataParallel(sharded, pg, o);
    auto eager = FullyShardedDataParallel(build_gpt(cfg, 0), pg, o);
    EXPECT_EQ(zero->unit_paths(), eager->unit_paths());
    expect_bitwise_equal(fsdp::testing::full_params(zero), fsdp::testing::full_params(eager));
    torch::optim::Adam opt_zero(zero->parameters(), 1e-3), opt_eager(eager->parameters(), 1e-3);
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = gpt_batch(step, cfg, pg.rank(), n);
      opt_zero.zero_grad(/*set_to_none=*/false);
      opt_eager.zero_grad(/*set_to_none=*/false);
      auto loss_zero = torch::cross_entropy_loss(zero->forward(x).reshape({-1, cfg.vocab}), y.reshape({-1}));
      auto loss_eager = torch::cross_entropy_loss(eager->forward(x).reshape({-1, cfg.vocab}), y.reshape({-1}));
      EXPECT_TRUE(torch::equal(loss_zero, loss_eager)) << "step " << step;
      loss_zero.backward();
      loss_eager.backward();
      opt_zero.step();
      opt_eager.step();
    }
    expect_bitwise_equal(fsdp::testing::full_params(zero), fsdp::testing::full_params(eager));
  });
}

// Resident bytes of this process's mapping of `path` (/proc/self/smaps).
int64_t mapped_rss(const std::string& path) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  int64_t kib = 0;
  while (std::getline(smaps, line)) {
    // Mapping headers start with "begin-end" in hex; field lines with "Name:".
    const std::string first = line.substr(0, line.find(' '));
    const bool header = first.find('-') != std::string::npos &&
                        std::all_of(first.begin(), first.end(), [](char c) { return c == '-' || std::isxdigit(c); });
    if (header) inside = line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0;
    else if (inside && line.rfind("Rss:", 0) == 0) kib += std::stoll(line.substr(4));
  }
  return kib * 1024;
}

StateDict params_of(torch::nn::Module& m) {
  StateDict sd;
  for (const auto& p : m.named_parameters()) sd.insert(p.key(), p.value().detach().clone());
  for (const auto& b : m.named_buffers()) sd.insert(b.key(), b.value().detach().clone());
  return sd;
}

// A pretrained dict that only rank 0 reads, loaded unit by unit; the reference
// is eager loading (every rank reads the whole file, load_state_dict).
void rank0_load_cases(comm::ProcessGroup& pg) {
  const GptConfig cfg{/*vocab=*/64, /*layers=*/4, /*dim=*/32, /*heads=*/4, /*context=*/16};
  const auto o = Options().auto_wrap_policy(module_type_policy<GptBlockImpl>());
  const std::string path = fsdp::testing::worker_scratch_dir() + "/pretrained.pt";
  if (pg.rank() == 0) save_full_state_dict(params_of(*build_gpt(cfg, 21)), path);
  comm::barrier(pg);

  run_case("rank-0 pretrained load equals eager loading", [&] {
    auto* counter = memory::install_counting_allocator();
    auto eager = FullyShardedDataParallel(build_gpt(cfg, 5), pg, o);
    int64_t base = counter->live();
    counter->reset_peak();
    load_state_dict(*eager, load_full_state_dict(path));
    const int64_t eager_peak = counter->peak() - base;

    auto zero = FullyShardedDataParallel(build_gpt(cfg, 5, &pg, &o), pg, o);
    StateDict dict;
    if (pg.rank() == 0) dict = map_full_state_dict(path);
    base = counter->live();
    counter->reset_peak();
    load_state_dict_from_rank0(*zero, dict);
    const int64_t peak = counter->peak() - base;

    // Bit for bit: the shards of eager loading, and the pretrained values.
    const auto z = fsdp::testing::full_params(zero);
    expect_bitwise_equal(z, fsdp::testing::full_params(eager));
    const StateDict file = load_full_state_dict(path);
    for (const auto& [name, t] : z) EXPECT_TRUE(torch::equal(t, file[name])) << name;

    // Memory: one unit's full flat buffer at a time (the root: embeddings and
    // head), nothing more; eager loading holds the whole dict on every rank.
    int64_t model_bytes = 0, root_bytes = 0, block_bytes = 0;
    for (const auto& kv : file) {
      model_bytes += kv.value().nbytes();
      if (kv.key().rfind("block0.", 0) == 0) block_bytes += kv.value().nbytes();
      if (kv.key().rfind("block", 0) != 0) root_bytes += kv.value().nbytes();
    }
    const int64_t largest_unit = comm::padded_numel(std::max(root_bytes, block_bytes) / 4, pg.size()) * 4;
    std::cout << "[rank " << pg.rank() << "] pretrained load peak: rank-0 streamed " << peak << " B (largest unit "
              << largest_unit << " B), eager " << eager_peak << " B (model " << model_bytes << " B)" << std::endl;
    EXPECT_LE(peak, largest_unit * 105 / 100 + 4096);
    EXPECT_GE(eager_peak, model_bytes);
    // Rank 0's mapping of the file keeps no pages once each unit is copied.
    if (pg.rank() == 0) {
      const int64_t rss = mapped_rss(path);
      std::cout << "[rank 0] mapped file resident after the load: " << rss << " B" << std::endl;
      EXPECT_LE(rss, 64 * 1024);
      EXPECT_TRUE(torch::equal(dict["head.weight"], file["head.weight"]));  // read again from the file
    }
  });

  // HYBRID_SHARD, shard groups of 2 at 4 ranks: each unit is split over a group of 2
  // and replicated in the other, so rank 0's values must reach both groups and each
  // rank keep the piece of its place in its own group.
  if (pg.size() == 4)
    run_case("rank-0 pretrained load under hybrid_shard equals eager loading", [&] {
      const auto h = Options(o).sharding_strategy(ShardingStrategy::kHybridShard).shard_group_size(2);
      auto eager = FullyShardedDataParallel(build_gpt(cfg, 5), pg, h);
      load_state_dict(*eager, load_full_state_dict(path));
      auto zero = FullyShardedDataParallel(build_gpt(cfg, 5, &pg, &h), pg, h);
      StateDict dict;
      if (pg.rank() == 0) dict = map_full_state_dict(path);
      load_state_dict_from_rank0(*zero, dict);
      // Gathered within this rank's shard group: every group holds the whole model.
      const auto z = fsdp::testing::full_params(zero);
      expect_bitwise_equal(z, fsdp::testing::full_params(eager));
      const StateDict file = load_full_state_dict(path);
      for (const auto& [name, t] : z) EXPECT_TRUE(torch::equal(t, file[name])) << name;
      // The shards too, not only what a gather makes of them: half of each unit here.
      std::map<std::string, torch::Tensor> shards_eager, shards_zero;
      for (const auto& p : eager->named_parameters()) shards_eager[p.key()] = p.value().detach().clone();
      for (const auto& p : zero->named_parameters()) shards_zero[p.key()] = p.value().detach().clone();
      expect_bitwise_equal(shards_zero, shards_eager);
      EXPECT_EQ(zero->memory_stats().param_shard_bytes, eager->memory_stats().param_shard_bytes);
    });

  run_case("rank-0 load: unsharded units and a mismatching dict", [&] {
    // NO_SHARD: every unit's shard is its whole flat buffer, broadcast in place.
    const auto no_shard = Options(o).sharding_strategy(ShardingStrategy::kNoShard);
    auto m = FullyShardedDataParallel(build_gpt(cfg, 5), pg, no_shard);
    load_state_dict_from_rank0(*m, pg.rank() == 0 ? load_full_state_dict(path) : StateDict());
    const StateDict file = load_full_state_dict(path);
    for (const auto& [name, t] : fsdp::testing::full_params(m)) EXPECT_TRUE(torch::equal(t, file[name])) << name;

    // Rank 0's dict does not fit: every rank fails naming the key, nothing changed.
    auto zero = FullyShardedDataParallel(build_gpt(cfg, 5, &pg, &o), pg, o);
    const auto before = fsdp::testing::full_params(zero);
    auto broken = [&](const std::function<void(StateDict&)>& edit) {
      StateDict d;
      if (pg.rank() == 0) {
        for (const auto& kv : file) d.insert(kv.key(), kv.value());
        edit(d);
      }
      return error_of([&] { load_state_dict_from_rank0(*zero, d); });
    };
    std::string err = broken([](StateDict& d) { d.erase("block2.fc1.weight"); });
    EXPECT_NE(err.find("missing key 'block2.fc1.weight'"), std::string::npos) << err;
    EXPECT_NE(err.find("Nothing was loaded"), std::string::npos) << err;
    err = broken([](StateDict& d) { d["block3.attn.q.bias"] = torch::zeros({31}); });
    EXPECT_NE(err.find("'block3.attn.q.bias' has shape [31]"), std::string::npos) << err;
    err = broken([](StateDict& d) { d.insert("extra", torch::zeros({1})); });
    EXPECT_NE(err.find("unexpected key 'extra'"), std::string::npos) << err;
    expect_bitwise_equal(fsdp::testing::full_params(zero), before);
  });
}

}  // namespace

TEST(ShardedInit, ShardedConstruction) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    sharded_init_cases(pg);
    rank0_load_cases(pg);
  });
}
// Both readers of a full state dict file (load_full_state_dict reads it,
// map_full_state_dict maps it) check what they unpickled in one place and fail with
// the same words, naming themselves and the file.
TEST(ShardedInit, StateDictFileOfAnotherKindFailsInBothReaders) {
  const auto dir = fsdp::testing::TempDir::create("fsdp-unpickled-");
  auto write = [&](const std::string& name, const c10::IValue& v) {
    const std::string path = dir.path() + "/" + name;
    const std::vector<char> bytes = torch::pickle_save(v);
    std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    return path;
  };
  // (Two entries each: the 1.13 C++ unpickler rejects one-element lists and dicts.)
  const std::string list = write("list.pt", c10::List<at::Tensor>({torch::zeros({2}), torch::ones({1})}));
  c10::Dict<std::string, int64_t> ints;
  ints.insert("a", 1);
  ints.insert("b", 2);
  const std::string not_tensors = write("ints.pt", ints);
  const std::string garbage = dir.path() + "/garbage.pt";
  std::ofstream(garbage) << "not a pickle";
  for (const std::string fn : {"load_full_state_dict", "map_full_state_dict"}) {
    auto read = [&](const std::string& path) {
      return error_of([&] { fn == "map_full_state_dict" ? map_full_state_dict(path) : load_full_state_dict(path); });
    };
    std::string err = read(list);
    EXPECT_NE(err.find("fsdp: " + fn + ": '" + list + "' holds a GenericList, not a dict of tensors (save it with "
                       "torch.save(dict(model.state_dict()), path))"),
              std::string::npos)
        << err;
    err = read(not_tensors);
    EXPECT_NE(err.find("fsdp: " + fn + ": '" + not_tensors + "' has a non-string key or non-tensor value"),
              std::string::npos)
        << err;
    if (fn == "load_full_state_dict") {  // (map_full_state_dict stops earlier: not a zip file)
      err = read(garbage);
      EXPECT_NE(err.find("fsdp: " + fn + ": cannot unpickle '" + garbage + "' ("), std::string::npos) << err;
      EXPECT_NE(err.find("an OrderedDict with _metadata is not readable from C++"), std::string::npos) << err;
    }
  }
}

TEST(ShardedInit, Gpt16ConstructionPeakN2) { run_ranks(2, gpt16_cases); }
TEST(ShardedInit, Gpt16ConstructionPeakN4) {
  run_ranks(4, [](comm::ProcessGroup& pg) {
    gpt16_cases(pg);
    rank0_load_cases(pg);
  });
}
