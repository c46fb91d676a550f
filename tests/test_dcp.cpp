// PyTorch Distributed Checkpoint directories (fsdp/state/dcp.h) between world sizes and
// strategies: saved at N = 3 (pieces that start mid-row, saved as boxes), loaded at N = 2
// and N = 1 (unsharded) with Adam's state, values bitwise equal and training continuing as
// the uninterrupted run; the boxes of a flat range against a brute-force cover; mismatches
// refused on every rank before anything changed. Python's FSDP2 against ours:
// tests/scripts/test_dcp_interop.sh.
#include <gtest/gtest.h>

#include <filesystem>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/state/dcp.h"
#include "fsdp/state/state_dict.h"
#include "harness/error_of.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/test_dir.h"
#include "state/dcp_boxes.h"

using namespace fsdp;
using namespace fsdp::testing;
namespace fs = std::filesystem;
namespace dcp = fsdp::state::dcp;

namespace {

using Model = FullyShardedDataParallel<TinyTransformerImpl>;

// Every flat range of a few shapes: the boxes are disjoint, consecutive in flat order, and
// cover exactly the range; a box's runs are its elements.
TEST(DcpBoxes, CoverFlatRangesExactly) {
  for (const std::vector<int64_t> shape : {std::vector<int64_t>{13, 17}, {5}, {3, 4, 5}, {2, 1, 3, 2}, {}}) {
    const int64_t n = dcp::numel_of(shape);
    for (int64_t b = 0; b <= n; ++b)
      for (int64_t e = b; e <= n; ++e) {
        std::vector<int64_t> seen;
        const auto boxes = dcp::boxes_of(shape, b, e);
        if (shape.size() == 2) EXPECT_LE(boxes.size(), 3u);
        for (const auto& box : boxes) {
          const auto runs = dcp::runs_of(shape, box);
          ASSERT_EQ(runs.size(), 1u) << "a box of a flat range is one run";
          EXPECT_EQ(runs[0].length, dcp::numel_of(box.sizes));
          for (int64_t i = 0; i < runs[0].length; ++i) seen.push_back(runs[0].flat + i);
        }
        ASSERT_EQ(int64_t(seen.size()), e - b) << b << " " << e;
        for (int64_t i = 0; i < e - b; ++i) ASSERT_EQ(seen[i], b + i);
      }
  }
  // A column block of a matrix (tensor parallelism's boxes) is one run per row.
  const auto runs = dcp::runs_of({4, 6}, dcp::Chunk{{1, 2}, {2, 3}});
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].flat, 8);
  EXPECT_EQ(runs[1].flat, 14);
  EXPECT_EQ(runs[1].local, 3);
}

Model wrap(uint64_t seed, comm::ProcessGroup& pg, ShardingStrategy s = ShardingStrategy::kFullShard) {
  return Model(make_transformer(seed), pg, Options().sharding_strategy(s).auto_wrap_policy(always_wrap_policy()));
}

void adam_step(Model& m, torch::optim::Adam& opt, int64_t step, const comm::ProcessGroup& pg) {
  auto [x, y] = global_batch(step, 12);
  opt.zero_grad(/*set_to_none=*/true);
  torch::mse_loss(m->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size())).backward();
  opt.step();
}

std::map<std::string, torch::Tensor> state_of(Model& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& kv : state_dict(*m)) out[kv.key()] = kv.value();
  return out;
}

void expect_same(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) EXPECT_TRUE(torch::equal(v, b.at(k))) << k;
}

// Saved at 3 ranks after 2 Adam steps; loaded at 2 ranks (SHARD_GRAD_OP) and trained 2 more
// steps: the parameters equal those of 4 uninterrupted steps at 2 ranks within rounding.
TEST(Dcp, SaveAtThreeLoadAtTwoContinues) {
  const std::string dir = test_dir() + "/dcp_3";
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    Model m = wrap(1, pg);
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
    for (int64_t s = 0; s < 2; ++s) adam_step(m, opt, s, pg);
    save_dcp(*m, &opt, dir);
    const auto saved = state_of(m);
    if (pg.rank() == 0) torch::save(saved.at("proj.weight"), test_dir() + "/dcp_3_proj.pt");
  }, rank_options());
  ASSERT_TRUE(fs::exists(dir + "/.metadata"));
  ASSERT_FALSE(fs::exists(dir + ".tmp"));
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    Model ref = wrap(1, pg);
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
    for (int64_t s = 0; s < 2; ++s) adam_step(ref, ref_opt, s, pg);
    Model m = wrap(9, pg, ShardingStrategy::kShardGradOp);
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(5e-1));
    const DcpLoadResult r = load_dcp(*m, &opt, dir);
    EXPECT_GT(r.bytes_read, 0);
    EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 1e-2);
    torch::Tensor proj;
    torch::load(proj, test_dir() + "/dcp_3_proj.pt");
    EXPECT_TRUE(torch::equal(state_of(m).at("proj.weight"), proj));
    for (int64_t s = 2; s < 4; ++s) {
      adam_step(ref, ref_opt, s, pg);
      adam_step(m, opt, s, pg);
    }
    for (const auto& [k, v] : state_of(ref)) EXPECT_LT(rel_diff(state_of(m).at(k), v), 1e-5) << k;
  }, rank_options());
  // Unsharded, one process: the same values, the same Adam state.
  auto plain = make_transformer(5);
  torch::optim::Adam opt(plain->parameters(), torch::optim::AdamOptions(1e-3));
  load_dcp(*plain, &opt, dir);
  torch::Tensor proj;
  torch::load(proj, test_dir() + "/dcp_3_proj.pt");
  EXPECT_TRUE(torch::equal(plain->proj->weight, proj));
  const auto& st = static_cast<torch::optim::AdamParamState&>(
      *opt.state().at(plain->proj->weight.unsafeGetTensorImpl()));
  EXPECT_EQ(st.step(), 2);
  EXPECT_EQ(st.exp_avg().sizes(), plain->proj->weight.sizes());
}

TEST(Dcp, MismatchFailsEveryRankAlike) {
  const std::string dir = test_dir() + "/dcp_mismatch";
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    Model m = wrap(2, pg);
    save_dcp(*m, nullptr, dir);
    // Another model (one more output): refused on every rank, nothing changed.
    torch::manual_seed(3);
    FullyShardedDataParallel<TinyTransformerImpl> other(TinyTransformer(13, 24, 6, 2), pg,
                                                         Options().auto_wrap_policy(always_wrap_policy()));
    const auto before = state_of(other);
    const std::string err = error_of([&] { load_dcp(*other, nullptr, dir); });
    EXPECT_NE(err.find("rank 0 failed: '" + std::string("model.head.weight") + "' has shape [5, 24], the model's "
                       "'head.weight' [6, 24]"), std::string::npos) << err;
    EXPECT_NE(err.find("Nothing was loaded on any rank"), std::string::npos) << err;
    expect_same(state_of(other), before);
    // No optimizer state in the checkpoint: asking for it is refused, naming the key.
    torch::optim::Adam opt(m->parameters());
    const std::string err2 = error_of([&] { load_dcp(*m, &opt, dir); });
    EXPECT_NE(err2.find("holds no 'optim.*' keys"), std::string::npos) << err2;
  }, rank_options());
  const std::string err = error_of([&] { load_dcp(*make_transformer(0), nullptr, test_dir() + "/nothing"); });
  EXPECT_NE(err.find("holds no .metadata"), std::string::npos) << err;
}

}  // namespace
