// Checkpoint directories (fsdp/state/checkpoint.h): save at N=4, load at N=1..4
// under other strategies and wrap policies; the continued training must equal the
// uninterrupted run (bitwise at the same world size and strategy, fp32 tolerance
// otherwise), for Adam, AdamW and SGD with momentum. Crash safety and checksums;
// a load that fails on one rank changes nothing on any rank.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/optim/cpu_adam.h"
#include "fsdp/state/checkpoint.h"
#include "harness/test_dir.h"
#include "state/checkpoint_testing.h"
#include "fsdp/state/checkpoint_tools.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/state/state_dict.h"
#include "fsdp/state/summon_full_params.h"
#include "harness/error_of.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBatch = 12;  // divisible by 1, 2, 3 and 4
constexpr int64_t kSaveStep = 3, kSteps = 6;

using Model = FullyShardedDataParallel<TinyTransformerImpl>;
const char* kOptimizers[] = {"adam", "adamw", "sgd", "cpu_adam"};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, Model& m) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-2));
  if (kind == "adamw")
    return std::make_unique<torch::optim::AdamW>(m->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  if (kind == "cpu_adam") return std::make_unique<optim::CPUAdam>(m->parameters(), optim::CPUAdamOptions(1e-2));
  return std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

Model wrap(uint64_t seed, comm::ProcessGroup& pg, ShardingStrategy s, bool wrap_all) {
  auto opts = Options().sharding_strategy(s);
  if (wrap_all) opts.auto_wrap_policy(always_wrap_policy());
  return Model(make_transformer(seed), pg, opts);
}

void train(Model& m, torch::optim::Optimizer& opt, int64_t from, int64_t to, const comm::ProcessGroup& pg) {
  for (int64_t s = from; s < to; ++s) {
    auto [x, y] = global_batch(s, kBatch);
    opt.zero_grad(/*set_to_none=*/false);
    // .to(kFloat): a no-op except under bf16 mixed precision.
    auto loss = torch::mse_loss(m->forward(rank_slice(x, pg.rank(), pg.size())).to(torch::kFloat),
                                rank_slice(y, pg.rank(), pg.size()));
    loss.backward();
    opt.step();
  }
}

void save_params(const std::map<std::string, torch::Tensor>& p, const std::string& path) {
  std::vector<torch::Tensor> v;
  for (const auto& kv : p) v.push_back(kv.second);
  torch::save(v, path);
}
std::vector<torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> v;
  torch::load(v, path);
  return v;
}
std::vector<torch::Tensor> values(const std::map<std::string, torch::Tensor>& p) {
  std::vector<torch::Tensor> v;
  for (const auto& kv : p) v.push_back(kv.second);
  return v;
}

// Phase 1 at N=4 (FULL_SHARD, every block a unit): train, save, continue; record
// the state at the save and after the uninterrupted run, and reload at N=4 into a
// fresh model (other seed): bitwise equal continuation.
void save_phase(comm::ProcessGroup& pg) {
  for (const std::string kind : kOptimizers) {
    run_case("save " + kind, [&] {
      const std::string dir = test_dir() + "/" + kind;
      auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
      auto opt = make_optimizer(kind, m);
      train(m, *opt, 0, kSaveStep, pg);
      CheckpointExtra extra;
      extra.values["step"] = std::to_string(kSaveStep);
      extra.tensors["rng"] = torch::arange(7, torch::kUInt8);
      save_checkpoint(dir, *m, opt.get(), extra);
      auto at_save = full_params(m);
      train(m, *opt, kSaveStep, kSteps, pg);
      auto final_params = full_params(m);
      if (pg.rank() == 0) {
        save_params(at_save, dir + ".at_save.pt");
        save_params(final_params, dir + ".final.pt");
      }
      // Reload at the same world size and strategy: bitwise.
      auto m2 = wrap(7, pg, ShardingStrategy::kFullShard, true);
      auto opt2 = make_optimizer(kind, m2);
      auto got = load_checkpoint(dir, *m2, opt2.get());
      EXPECT_EQ(got.values["step"], "3");
      ASSERT_TRUE(got.tensors.count("rng"));
      EXPECT_TRUE(torch::equal(got.tensors["rng"], torch::arange(7, torch::kUInt8)));
      train(m2, *opt2, kSaveStep, kSteps, pg);
      auto p2 = full_params(m2);
      for (const auto& kv : final_params)
        EXPECT_TRUE(torch::equal(kv.second, p2.at(kv.first))) << kind << " " << kv.first << " differs after reload at N=4";
      comm::barrier(pg);
    });
  }
  run_case("HYBRID_SHARD: the first replica group writes; loads under FULL_SHARD", [&] {
    const std::string dir = test_dir() + "/hybrid";
    auto m = Model(make_transformer(0), pg, Options().sharding_strategy(ShardingStrategy::kHybridShard)
                                               .shard_group_size(2).auto_wrap_policy(always_wrap_policy()));
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, 2, pg);
    save_checkpoint(dir, *m, opt.get());
    EXPECT_TRUE(fs::exists(dir + "/shard_rank00001.bin"));
    EXPECT_FALSE(fs::exists(dir + "/shard_rank00002.bin"));
    const auto expected = full_params(m);
    auto m2 = wrap(4, pg, ShardingStrategy::kFullShard, false);
    auto opt2 = make_optimizer("adam", m2);
    load_checkpoint(dir, *m2, opt2.get());
    auto got = full_params(m2);
    for (const auto& kv : expected) EXPECT_TRUE(torch::equal(got.at(kv.first), kv.second)) << kv.first;
    comm::barrier(pg);
  });
}

struct LoadConfig {
  ShardingStrategy strategy;
  bool wrap_all;
};

// Phase 2 at N=M: load the N=4 checkpoint under each config; parameters equal the
// saved ones exactly, and the continued run equals the uninterrupted one.
void load_phase(comm::ProcessGroup& pg, const std::vector<LoadConfig>& configs) {
  for (const std::string kind : kOptimizers) {
    // CPUAdam shares Adam's state layout: one world size is enough for it.
    if (kind == "cpu_adam" && pg.size() != 2) continue;
    for (const auto& c : configs) {
      run_case("load " + kind + " " + to_string(c.strategy) + (c.wrap_all ? " wrap_all" : " root"), [&] {
        const std::string dir = test_dir() + "/" + kind;
        auto m = wrap(11, pg, c.strategy, c.wrap_all);
        auto opt = make_optimizer(kind, m);
        load_checkpoint(dir, *m, opt.get());
        auto loaded = values(full_params(m));
        auto at_save = load_params(dir + ".at_save.pt");
        ASSERT_EQ(loaded.size(), at_save.size());
        for (size_t i = 0; i < loaded.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], at_save[i])) << i;
        train(m, *opt, kSaveStep, kSteps, pg);
        auto got = values(full_params(m));
        auto expected = load_params(dir + ".final.pt");
        for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(rel_diff(got[i], expected[i]), 2e-5) << kind << " param " << i;

        // The test can fail: the same run with parameters but no optimizer state
        // (Adam restarted from zero) is far from the uninterrupted one.
        if (kind == "adam" && c.wrap_all) {
          auto m3 = wrap(11, pg, c.strategy, c.wrap_all);
          auto opt3 = make_optimizer(kind, m3);
          load_checkpoint(dir, *m3, nullptr);
          train(m3, *opt3, kSaveStep, kSteps, pg);
          auto fresh = values(full_params(m3));
          double worst = 0;
          for (size_t i = 0; i < fresh.size(); ++i) worst = std::max(worst, rel_diff(fresh[i], expected[i]));
          EXPECT_GT(worst, 1e-3) << "restarting Adam should be detectable";
        }
      });
    }
  }
}

void flip_byte(const std::string& path, int64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(at);
  f.write(&c, 1);
}

}  // namespace

TEST(Checkpoint, ReshardAcrossWorldSizesAndStrategies) {
  run_ranks(4, save_phase, rank_options());
  run_ranks(1, [](comm::ProcessGroup& pg) {
    load_phase(pg, {{ShardingStrategy::kFullShard, false}, {ShardingStrategy::kNoShard, true}});
  }, rank_options());
  run_ranks(2, [](comm::ProcessGroup& pg) {
    load_phase(pg, {{ShardingStrategy::kShardGradOp, true}, {ShardingStrategy::kNoShard, false}});
  }, rank_options());
  run_ranks(3, [](comm::ProcessGroup& pg) { load_phase(pg, {{ShardingStrategy::kFullShard, true}}); },
            rank_options());
  // Under NO_SHARD one replica writes: a 2-rank NO_SHARD save has one shard file.
  run_ranks(2, [](comm::ProcessGroup& pg) {
    run_case("no_shard one writer", [&] {
      const std::string dir = test_dir() + "/no_shard";
      auto m = wrap(0, pg, ShardingStrategy::kNoShard, true);
      auto opt = make_optimizer("adam", m);
      train(m, *opt, 0, 2, pg);
      save_checkpoint(dir, *m, opt.get());
      EXPECT_TRUE(fs::exists(dir + "/shard_rank00000.bin"));
      EXPECT_FALSE(fs::exists(dir + "/shard_rank00001.bin"));
    });
  }, rank_options());
}

// Records of megabytes are committed with streaming stores ([Note: streaming commit
// copies] in src/state/checkpoint_format.cpp); the tiny models above never reach
// that path. Saved at N=3, loaded at N=2: odd sizes put records at destinations
// that are not 16-byte aligned and cut others into pieces below the threshold.
// Parameters and Adam moments must come back bit for bit.
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The path a CUDA model's records take ([Note: staging device tensors]: through a host buffer,
// chunk by chunk, checksummed as they go), taken here by host tensors: 100-byte chunks (25
// fp32 elements, so records end inside a chunk and span several) write the same files, byte
// for byte, with the same checksums, and the checkpoint loads.
TEST(Checkpoint, StagedRecordsAreTheSameBytes) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, 2, pg);
    const std::string plain = test_dir() + "/plain", staged = test_dir() + "/staged";
    save_checkpoint(plain, *m, opt.get());
    fsdp::state::detail::set_checkpoint_stage_host_tensors(true);
    fsdp::state::detail::set_checkpoint_staging_chunk_bytes(100);
    save_checkpoint(staged, *m, opt.get());
    fsdp::state::detail::set_checkpoint_stage_host_tensors(false);
    fsdp::state::detail::set_checkpoint_staging_chunk_bytes(0);
    const std::string mine = "/shard_rank0000" + std::to_string(pg.rank()) + ".bin";
    const std::string a = file_bytes(plain + mine), b = file_bytes(staged + mine);
    EXPECT_GT(a.size(), 400u) << "records this small would not cross chunks";
    EXPECT_TRUE(a == b) << "rank " << pg.rank() << "'s file differs when staged";
    const auto meta_a = nlohmann::json::parse(file_bytes(plain + "/metadata.json"));
    const auto meta_b = nlohmann::json::parse(file_bytes(staged + "/metadata.json"));
    EXPECT_EQ(meta_a.at("records"), meta_b.at("records"));  // offsets and CRC-32s
    EXPECT_EQ(meta_a.at("files"), meta_b.at("files"));      // sizes and whole-file CRC-32s
    auto fresh = wrap(1, pg, ShardingStrategy::kFullShard, true);
    auto fresh_opt = make_optimizer("adam", fresh);
    load_checkpoint(staged, *fresh, fresh_opt.get());
    const auto want = values(full_params(m)), got = values(full_params(fresh));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], want[i])) << "parameter " << i;
  }, rank_options());
}

TEST(Checkpoint, MegabyteRecordsLoadBitwiseAtAnotherWorldSize) {
  using Lin = FullyShardedDataParallel<torch::nn::LinearImpl>;
  auto make = [](int seed, comm::ProcessGroup& pg) {
    torch::manual_seed(seed);
    return Lin(torch::nn::Linear(1001, 1003), pg, Options());  // 1,005,006 elements: 1.34 MB pieces at N=3
  };
  const std::string dir = test_dir() + "/large";
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    auto m = make(0, pg);
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
    torch::manual_seed(100 + pg.rank());
    m->forward(torch::randn({4, 1001})).square().sum().backward();
    opt.step();
    save_checkpoint(dir, *m, &opt);
    const auto params = full_params(m);
    const auto osd = full_optim_state_dict(*m, opt);
    if (pg.rank() == 0) {
      save_params(params, dir + ".params.pt");
      save_optim_state_dict(osd, dir + ".optim.pt");
    }
  }, rank_options());
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    auto m = make(1, pg);
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
    load_checkpoint(dir, *m, &opt);
    const auto got = values(full_params(m));
    const auto expected = load_params(dir + ".params.pt");
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << "parameter " << i;
    const auto osd = full_optim_state_dict(*m, opt);
    if (pg.rank() == 0) {
      const auto saved = load_optim_state_dict_file(dir + ".optim.pt");
      ASSERT_EQ(osd.state.size(), saved.state.size());
      int compared = 0;
      for (const auto& [name, tensors] : saved.state)
        for (const auto& [kind, t] : tensors) {
          if (kind == "step") continue;
          ASSERT_TRUE(osd.state.count(name) && osd.state.at(name).count(kind)) << name << " " << kind;
          EXPECT_TRUE(torch::equal(osd.state.at(name).at(kind), t)) << name << " " << kind;
          ++compared;
        }
      EXPECT_EQ(compared, 4);  // exp_avg and exp_avg_sq of weight and bias
    }
  }, rank_options());
}

TEST(Checkpoint, CorruptionAndTruncationNameTheFile) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const std::string dir = test_dir() + "/c";
    auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, 2, pg);
    save_checkpoint(dir, *m, opt.get());
    comm::barrier(pg);
    if (pg.rank() == 0) {
      fs::copy(dir, dir + "_flip");
      fs::copy(dir, dir + "_cut");
      flip_byte(dir + "_flip/shard_rank00001.bin", 100);
      fs::resize_file(dir + "_cut/shard_rank00000.bin", fs::file_size(dir + "_cut/shard_rank00000.bin") - 9);
    }
    comm::barrier(pg);
    run_case("flipped byte", [&] {
      auto m2 = wrap(1, pg, ShardingStrategy::kFullShard, true);
      auto opt2 = make_optimizer("adam", m2);
      // Under NO_SHARD every rank needs every record, so every rank meets the flip.
      auto m3 = wrap(1, pg, ShardingStrategy::kNoShard, false);
      auto opt3 = make_optimizer("adam", m3);
      const auto err = error_of([&] { load_checkpoint(dir + "_flip", *m3, opt3.get()); });
      EXPECT_NE(err.find("shard_rank00001.bin"), std::string::npos) << err;
      EXPECT_NE(err.find("checksum"), std::string::npos) << err;
      // The intact original still loads.
      EXPECT_EQ(error_of([&] { load_checkpoint(dir, *m2, opt2.get()); }), "");
    });
    run_case("truncated file", [&] {
      auto m2 = wrap(1, pg, ShardingStrategy::kFullShard, true);
      const auto err = error_of([&] { load_checkpoint(dir + "_cut", *m2, nullptr); });
      EXPECT_NE(err.find("shard_rank00000.bin"), std::string::npos) << err;
      EXPECT_NE(err.find("truncated"), std::string::npos) << err;
    });
    run_case("consolidate of a flipped byte fails naming the file and leaves no output", [&] {
      if (pg.rank() != 0) return;
      const std::string out = dir + "_flip.pt";
      const auto err = error_of([&] { consolidate_checkpoint(dir + "_flip", out); });
      EXPECT_NE(err.find("shard_rank00001.bin"), std::string::npos) << err;
      EXPECT_NE(err.find("checksum"), std::string::npos) << err;
      EXPECT_FALSE(fs::exists(out));
      EXPECT_FALSE(fs::exists(out + ".tmp"));
    });
    const StateDict full = state_dict(*m);  // collective: every rank
    run_case("consolidate with ZIP64 fields reads back as without them", [&] {
      if (pg.rank() != 0) return;
      consolidate_checkpoint(dir, dir + ".pt");
      fsdp::state::detail::set_consolidate_zip64_always(true);
      consolidate_checkpoint(dir, dir + "_zip64.pt");
      fsdp::state::detail::set_consolidate_zip64_always(false);
      EXPECT_GT(fs::file_size(dir + "_zip64.pt"), fs::file_size(dir + ".pt")) << "no ZIP64 fields were written";
      auto plain = load_full_state_dict(dir + ".pt"), z64 = load_full_state_dict(dir + "_zip64.pt");
      ASSERT_EQ(plain.size(), full.size());
      ASSERT_EQ(z64.size(), full.size());
      for (const auto& kv : full) {
        ASSERT_NE(z64.find(kv.key()), nullptr) << kv.key();
        EXPECT_TRUE(torch::equal(plain[kv.key()], kv.value())) << kv.key();
        EXPECT_TRUE(torch::equal(z64[kv.key()], kv.value())) << kv.key();
      }
    });
    run_case("missing checkpoint", [&] {
      auto m2 = wrap(1, pg, ShardingStrategy::kFullShard, true);
      const auto err = error_of([&] { load_checkpoint(dir + "_none", *m2, nullptr); });
      EXPECT_NE(err.find("metadata.json"), std::string::npos) << err;
    });
  }, rank_options());
}

namespace {

// What a rank holds that a load may change: its parameter pieces, its Adam
// moments and steps, the number of state entries and the learning rate.
struct RankState {
  std::vector<torch::Tensor> tensors;
  std::vector<int64_t> steps;  // -1: no state for that parameter
  size_t entries = 0;
  double lr = 0;
};

RankState rank_state(Model& m, torch::optim::Optimizer& opt) {
  RankState s;
  for (const auto& p : m->parameters()) s.tensors.push_back(p.detach().clone());
  for (const auto& p : opt.param_groups()[0].params()) {
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) {
      s.steps.push_back(-1);
      continue;
    }
    auto& st = static_cast<torch::optim::AdamParamState&>(*it->second);
    s.tensors.push_back(st.exp_avg().clone());
    s.tensors.push_back(st.exp_avg_sq().clone());
    s.steps.push_back(st.step());
  }
  s.entries = opt.state().size();
  s.lr = opt.param_groups()[0].options().get_lr();
  return s;
}

void expect_same_state(const RankState& got, const RankState& want, const std::string& what) {
  ASSERT_EQ(got.tensors.size(), want.tensors.size()) << what;
  for (size_t i = 0; i < got.tensors.size(); ++i)
    EXPECT_TRUE(torch::equal(got.tensors[i], want.tensors[i])) << what << ": tensor " << i << " changed";
  EXPECT_EQ(got.steps, want.steps) << what;
  EXPECT_EQ(got.entries, want.entries) << what;
  EXPECT_EQ(got.lr, want.lr) << what;
}

// A checkpoint at step 3 (Adam); the model then trains on to step 5 with another
// learning rate, so that every value a load would write differs. Rank B = the
// last rank meets a fault in its own part only, while the others' parts are
// intact: each load must throw on every rank, naming rank B and the file or
// item, and change nothing anywhere; training then continues exactly like a
// reference that never tried to load; the intact checkpoint still loads bitwise.
void failed_load_changes_nothing(comm::ProcessGroup& pg) {
  const int bad = pg.size() - 1;
  const std::string dir = test_dir() + "/atomic" + std::to_string(pg.size());
  char file[64];
  std::snprintf(file, sizeof(file), "shard_rank%05d.bin", bad);
  auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
  auto opt = make_optimizer("adam", m);
  train(m, *opt, 0, kSaveStep, pg);
  save_checkpoint(dir, *m, opt.get());
  const RankState at_save = rank_state(m, *opt);
  auto ref = wrap(0, pg, ShardingStrategy::kFullShard, true);
  auto ref_opt = make_optimizer("adam", ref);
  train(ref, *ref_opt, 0, kSaveStep, pg);
  for (auto* o : {opt.get(), ref_opt.get()}) o->param_groups()[0].options().set_lr(5e-3);
  train(m, *opt, kSaveStep, kSaveStep + 2, pg);
  train(ref, *ref_opt, kSaveStep, kSaveStep + 2, pg);
  if (pg.rank() == 0) {
    for (const char* v : {"_flip", "_cut", "_gone", "_shape"}) fs::copy(dir, dir + v);
    // The last bytes of rank B's file: its last record (an Adam moment), which
    // a load that wrote as it read would reach after everything else.
    flip_byte(dir + "_flip/" + file, static_cast<int64_t>(fs::file_size(dir + "_flip/" + file)) - 2);
    fs::resize_file(dir + "_cut/" + file, fs::file_size(dir + "_cut/" + file) - 9);
    fs::remove(dir + "_gone/" + file);
    const std::string mf = dir + "_shape/metadata.json";
    std::ifstream in(mf);
    auto meta = nlohmann::json::parse(in);
    in.close();
    meta["items"]["head.bias"]["shape"] = nlohmann::json::array({6});  // 5 in the model
    std::ofstream(mf) << meta.dump(1);
  }
  comm::barrier(pg);
  const RankState before = rank_state(m, *opt);
  struct Fault {
    const char* name;
    std::string dir_on_bad;  // the other ranks load the intact `dir`, except for _flip
    std::vector<std::string> said;
  };
  const Fault faults[] = {
      {"a flipped byte in rank B's last record", dir + "_flip", {file, "checksum"}},
      {"rank B's file truncated (rank B's copy only)", dir + "_cut", {file, "truncated"}},
      {"rank B's file missing (rank B's copy only)", dir + "_gone", {file, "missing"}},
      {"one parameter's shape differs (rank B's copy only)", dir + "_shape", {"head.bias", "shape"}},
  };
  for (const auto& f : faults) {
    run_case(std::string("failed load changes nothing: ") + f.name, [&] {
      const bool everyone = f.dir_on_bad == dir + "_flip";
      const std::string mine = pg.rank() == bad || everyone ? f.dir_on_bad : dir;
      std::string err;
      try {
        load_checkpoint(mine, *m, opt.get());
      } catch (const c10::Error& e) {
        err = e.what_without_backtrace();  // as the tools print it
      }
      ASSERT_NE(err, "") << "the load succeeded on rank " << pg.rank();
      EXPECT_NE(err.find("failed on 1 of " + std::to_string(pg.size()) + " ranks"), std::string::npos) << err;
      EXPECT_NE(err.find("rank " + std::to_string(bad) + ": "), std::string::npos) << err;
      for (const auto& s : f.said) EXPECT_NE(err.find(s), std::string::npos) << "'" << s << "' not in: " << err;
      EXPECT_EQ(err.find("frame #"), std::string::npos) << "backtrace in the message: " << err;
      expect_same_state(rank_state(m, *opt), before, f.name);
    });
  }
  run_case("a failed load into an optimizer without state installs none", [&] {
    auto m2 = wrap(5, pg, ShardingStrategy::kFullShard, true);
    auto opt2 = make_optimizer("adam", m2);
    const RankState fresh = rank_state(m2, *opt2);
    EXPECT_NE(error_of([&] { load_checkpoint(dir + "_flip", *m2, opt2.get()); }), "");
    expect_same_state(rank_state(m2, *opt2), fresh, "fresh");
    EXPECT_EQ(opt2->state().size(), 0u);
  });
  run_case("training continues as if no load had been tried", [&] {
    train(m, *opt, kSaveStep + 2, kSaveStep + 4, pg);
    train(ref, *ref_opt, kSaveStep + 2, kSaveStep + 4, pg);
    expect_same_state(rank_state(m, *opt), rank_state(ref, *ref_opt), "continued vs reference");
    // The comparison can fail: two more steps changed the state.
    const RankState now = rank_state(m, *opt);
    bool moved = false;
    for (size_t i = 0; i < now.tensors.size(); ++i) moved = moved || !torch::equal(now.tensors[i], before.tensors[i]);
    EXPECT_TRUE(moved);
  });
  run_case("the intact checkpoint loads bitwise, in place", [&] {
    auto moments = [&] {
      std::vector<const void*> ptrs;
      for (const auto& p : opt->param_groups()[0].params())
        ptrs.push_back(static_cast<torch::optim::AdamParamState&>(
                           *opt->state().at(p.unsafeGetTensorImpl()))
                           .exp_avg()
                           .data_ptr());
      return ptrs;
    };
    const auto storage = moments();
    load_checkpoint(dir, *m, opt.get());
    expect_same_state(rank_state(m, *opt), at_save, "loaded");
    EXPECT_EQ(moments(), storage) << "the load replaced the optimizer's state tensors";
  });
}

}  // namespace

TEST(Checkpoint, FailedLoadOnOneRankChangesNothingOnAnyRank) {
  run_ranks(2, failed_load_changes_nothing, rank_options());
  run_ranks(3, failed_load_changes_nothing, rank_options());
}

namespace {
// The save at step 5 dies on every rank after its third record.
void crashing_save() {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    fsdp::state::detail::set_checkpoint_record_hook([](int64_t written) {
      if (written == 3) ::_exit(86);
    });
    auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, 5, pg);
    save_checkpoint(test_dir() + "/k", *m, opt.get());
  }, rank_options());
}
}  // namespace

TEST(Checkpoint, KilledSaveLeavesPreviousLoadable) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const std::string dir = test_dir() + "/k";
    auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, 2, pg);
    save_checkpoint(dir, *m, opt.get());
    auto p = full_params(m);
    if (pg.rank() == 0) save_params(p, dir + ".expected.pt");
  }, rank_options());
  if (is_worker()) crashing_save();
  else EXPECT_NONFATAL_FAILURE(crashing_save(), "exit 86");
  EXPECT_TRUE(is_worker() || fs::exists(test_dir() + "/k.tmp")) << "the crashed save should have left its temp dir";
  run_ranks(3, [](comm::ProcessGroup& pg) {
    run_case("previous checkpoint intact", [&] {
      const std::string dir = test_dir() + "/k";
      auto m = wrap(5, pg, ShardingStrategy::kFullShard, false);
      auto opt = make_optimizer("adam", m);
      load_checkpoint(dir, *m, opt.get());
      auto got = values(full_params(m));
      auto expected = load_params(dir + ".expected.pt");
      for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << i;
      comm::barrier(pg);
      // A crash between the two renames leaves only <dir>.old: still loadable.
      if (pg.rank() == 0) fs::rename(dir, dir + ".old");
      comm::barrier(pg);
      auto m2 = wrap(6, pg, ShardingStrategy::kFullShard, true);
      load_checkpoint(dir, *m2, nullptr);
      auto got2 = values(full_params(m2));
      for (size_t i = 0; i < got2.size(); ++i) EXPECT_TRUE(torch::equal(got2[i], expected[i])) << i;
      // The next save succeeds and replaces it.
      auto opt2 = make_optimizer("adam", m2);
      train(m2, *opt2, 2, 3, pg);
      save_checkpoint(dir, *m2, opt2.get());
      EXPECT_TRUE(fs::exists(dir + "/metadata.json"));
      EXPECT_FALSE(fs::exists(dir + ".tmp"));
    });
  }, rank_options());
}

// [Note: checkpoint directories are shared] in src/state/shared_directory.h: when the
// ranks do not see one directory (here rank 1 names another path, as a node-local disk
// would show it), the save fails at its start on every rank, naming the rank that does
// not see rank 0's directory and the fix, and leaves nothing behind. With one path the
// same ranks save.
TEST(Checkpoint, SaveRefusesADirectoryNotSharedByAllRanks) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const std::string base = test_dir() + "/unshared", elsewhere = base + "_node1";
    auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, 1, pg);
    const auto err = error_of([&] { save_checkpoint(pg.rank() == 1 ? elsewhere : base, *m, opt.get()); });
    EXPECT_NE(err.find("is not one directory for all ranks"), std::string::npos) << err;
    EXPECT_NE(err.find("rank 0 [pid"), std::string::npos) << err;  // the writer of the probe
    EXPECT_NE(err.find("but rank 1 [pid"), std::string::npos) << err;  // the rank that does not see it
    EXPECT_NE(err.find("must be on a file system shared by all nodes"), std::string::npos) << err;
    comm::barrier(pg);
    for (const auto& p : {base, base + ".tmp", elsewhere, elsewhere + ".tmp"}) EXPECT_FALSE(fs::exists(p)) << p;
    comm::barrier(pg);  // every rank has looked before rank 0 creates base.tmp again
    save_checkpoint(base, *m, opt.get());
    EXPECT_TRUE(fs::exists(base + "/metadata.json"));
    EXPECT_EQ(std::distance(fs::directory_iterator(base), fs::directory_iterator()), 3)
        << "expected metadata.json and one file per rank, no probe file";
  }, rank_options());
}

// FULL state dicts and summon_full_params at N=3, against apply_with_full_params
// and against the plain (unwrapped) model.
TEST(StateDict, FullRank0OnlyLoadAndSummon) {
  run_ranks(3, [](comm::ProcessGroup& pg) {
    auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, 2, pg);
    const auto ref = full_params(m);
    run_case("full rank0_only", [&] {
      StateDictTypeGuard guard(*m, StateDictType::kFull, FullStateDictConfig().offload_to_cpu(true).rank0_only(true));
      auto sd = state_dict(*m);
      if (pg.rank() != 0) {
        EXPECT_EQ(sd.size(), 0u);
        return;
      }
      EXPECT_EQ(sd.size(), ref.size());  // no buffers in this model
      for (const auto& kv : ref) {
        ASSERT_NE(sd.find(kv.first), nullptr) << kv.first;
        EXPECT_TRUE(torch::equal(sd[kv.first], kv.second)) << kv.first;
      }
    });
    run_case("full on every rank, loaded into the plain model", [&] {
      auto sd = state_dict(*m);  // default: FULL, every rank
      ASSERT_EQ(sd.size(), ref.size());
      auto plain = make_transformer(9);
      torch::NoGradGuard no_grad;
      for (auto& p : plain->named_parameters()) p.value().copy_(sd[p.key()]);
      auto [x, y] = global_batch(50, kBatch);
      auto expected = plain->forward(x);
      auto got = m->forward(x);
      EXPECT_LT(rel_diff(got, expected), 1e-6);
    });
    run_case("load_state_dict under another strategy", [&] {
      auto sd = state_dict(*m);
      auto m2 = wrap(5, pg, ShardingStrategy::kShardGradOp, false);
      load_state_dict(*m2, sd);
      auto got = full_params(m2);
      for (const auto& kv : ref) EXPECT_TRUE(torch::equal(got.at(kv.first), kv.second)) << kv.first;
      StateDict missing;
      for (const auto& kv : sd) if (kv.key() != "head.bias") missing.insert(kv.key(), kv.value());
      const auto err = error_of([&] { load_state_dict(*m2, missing); });
      EXPECT_NE(err.find("head.bias"), std::string::npos) << err;
    });
    run_case("LOCAL and SHARDED", [&] {
      auto m2 = wrap(5, pg, ShardingStrategy::kFullShard, true);
      {
        StateDictTypeGuard g(*m, StateDictType::kLocal);
        auto local = state_dict(*m);
        EXPECT_EQ(local.size(), m->unit_paths().size());
        StateDictTypeGuard g2(*m2, StateDictType::kLocal);
        load_state_dict(*m2, local);
      }
      auto got = full_params(m2);
      for (const auto& kv : ref) EXPECT_TRUE(torch::equal(got.at(kv.first), kv.second)) << "LOCAL " << kv.first;
      auto sharded = sharded_state_dict(*m);
      for (const auto& kv : sharded) {
        const auto& e = kv.value();
        EXPECT_TRUE(torch::equal(e.local, ref.at(kv.key()).reshape({-1}).slice(0, e.begin, e.end))) << kv.key();
      }
      auto m3 = wrap(6, pg, ShardingStrategy::kFullShard, true);
      load_sharded_state_dict(*m3, sharded);
      auto got3 = full_params(m3);
      for (const auto& kv : ref) EXPECT_TRUE(torch::equal(got3.at(kv.first), kv.second)) << "SHARDED " << kv.first;
      {
        StateDictTypeGuard g(*m, StateDictType::kSharded);
        auto sd = state_dict(*m);
        EXPECT_EQ(sd.size(), ref.size());
      }
      // Another layout is refused with the way out.
      auto m4 = wrap(6, pg, ShardingStrategy::kFullShard, false);
      const auto err = error_of([&] { load_sharded_state_dict(*m4, sharded); });
      auto refused = torch::tensor({err.empty() ? int64_t{0} : int64_t{1}});
      comm::all_reduce(pg, refused).wait();
      EXPECT_GE(refused.item<int64_t>(), 1) << "no rank noticed the other layout";
      if (!err.empty()) {
        EXPECT_NE(err.find("load_checkpoint"), std::string::npos) << err;
      }
    });
    run_case("summon_full_params", [&] {
      {
        SummonFullParams full(*m, SummonFullParamsOptions().writeback(true));
        for (const auto& p : m->module()->named_parameters()) {
          EXPECT_TRUE(torch::equal(p.value(), ref.at(p.key()))) << p.key();
        }
        torch::NoGradGuard no_grad;
        m->module()->head->weight.mul_(2);
      }
      auto after = full_params(m);
      EXPECT_TRUE(torch::equal(after.at("head.weight"), ref.at("head.weight") * 2));
      EXPECT_TRUE(torch::equal(after.at("proj.weight"), ref.at("proj.weight")));
      {
        SummonFullParams full(*m, SummonFullParamsOptions().writeback(false).rank0_only(true));
        const auto& w = m->module()->head->weight;
        if (pg.rank() == 0) EXPECT_EQ(w.sizes(), ref.at("head.weight").sizes());
        else EXPECT_EQ(w.dim(), 1);
        torch::NoGradGuard no_grad;
        if (pg.rank() == 0) m->module()->head->weight.mul_(3);  // not written back
      }
      auto after2 = full_params(m);
      EXPECT_TRUE(torch::equal(after2.at("head.weight"), ref.at("head.weight") * 2));
      EXPECT_NE(error_of([&] { SummonFullParams bad(*m, SummonFullParamsOptions().rank0_only(true)); }), "");
    });
    run_case("inside summon_full_params the other full-parameter users refuse", [&] {
      SummonFullParams full(*m, SummonFullParamsOptions().writeback(false));
      const auto shape = ref.at("head.weight").sizes().vec();
      // apply_with_full_params would otherwise gather again and, at its end,
      // point the parameters back at their shards under this open guard.
      const auto err = error_of([&] { fsdp::apply_with_full_params(*m, [](torch::nn::Module&) {}); });
      EXPECT_NE(err.find("apply_with_full_params"), std::string::npos) << err;
      EXPECT_NE(err.find("rank " + std::to_string(pg.rank())), std::string::npos) << err;
      EXPECT_NE(err.find("summon_full_params"), std::string::npos) << err;
      EXPECT_EQ(m->module()->head->weight.sizes().vec(), shape);
      EXPECT_NE(error_of([&] { SummonFullParams nested(*m); }), "");
      EXPECT_NE(error_of([&] { state_dict(*m); }), "");
      EXPECT_NE(error_of([&] { sharded_state_dict(*m); }), "");
      EXPECT_NE(error_of([&] { save_checkpoint(test_dir() + "/refused", *m, nullptr); }), "");
      EXPECT_EQ(m->module()->head->weight.sizes().vec(), shape);
    });
  }, rank_options());
}

// Optimizer state dicts at N=3: the full dict equals the state of unsharded Adam
// trained on the global batches; scatter / shard+load into other strategies
// continue like the original; rekeying round-trips.
TEST(OptimStateDict, FullMatchesUnshardedAdamAndScatterContinues) {
  run_ranks(3, [](comm::ProcessGroup& pg) {
    auto m = wrap(0, pg, ShardingStrategy::kFullShard, true);
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, kSaveStep, pg);
    // Independent reference: the plain model, one process, global batches.
    auto ref = make_transformer(0);
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
    for (int64_t s = 0; s < kSaveStep; ++s) {
      auto [x, y] = global_batch(s, kBatch);
      ref_opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(ref->forward(x), y).backward();
      ref_opt.step();
    }
    const auto osd = full_optim_state_dict(*m, *opt, /*rank0_only=*/false);
    run_case("full dict equals unsharded Adam", [&] {
      for (const auto& p : ref->named_parameters()) {
        auto& st = static_cast<torch::optim::AdamParamState&>(
            *ref_opt.state().at(p.value().unsafeGetTensorImpl()));
        ASSERT_TRUE(osd.state.count(p.key())) << p.key();
        const auto& got = osd.state.at(p.key());
        EXPECT_EQ(got.at("step").item<int64_t>(), kSaveStep);
        EXPECT_LT(rel_diff(got.at("exp_avg"), st.exp_avg()), 1e-5) << p.key();
        EXPECT_LT(rel_diff(got.at("exp_avg_sq"), st.exp_avg_sq()), 1e-5) << p.key();
        EXPECT_EQ(got.at("exp_avg").sizes(), p.value().sizes());
      }
      ASSERT_EQ(osd.param_groups.size(), 1u);
      EXPECT_EQ(osd.param_groups[0].params.size(), ref->parameters().size());
    });
    run_case("rank0_only", [&] {
      auto r0 = full_optim_state_dict(*m, *opt, true);
      EXPECT_EQ(r0.empty(), pg.rank() != 0);
    });
    run_case("rekey round trip", [&] {
      auto by_pos = rekey_optim_state_dict(osd, OptimKey::kByPosition, *m, *opt);
      EXPECT_TRUE(by_pos.state.count("0"));
      EXPECT_EQ(by_pos.param_groups[0].params[0], "0");
      auto back = rekey_optim_state_dict(by_pos, OptimKey::kByName, *m, *opt);
      for (const auto& kv : osd.state) EXPECT_TRUE(torch::equal(back.state.at(kv.first).at("exp_avg"), kv.second.at("exp_avg")));
    });
    // Continue the original for reference.
    const auto params_at = state_dict(*m);
    train(m, *opt, kSaveStep, kSteps, pg);
    const auto expected = full_params(m);
    auto check_continues = [&](Model& m2, torch::optim::Optimizer& opt2, const char* what) {
      load_state_dict(*m2, params_at);
      train(m2, opt2, kSaveStep, kSteps, pg);
      auto got = full_params(m2);
      for (const auto& kv : expected) EXPECT_LT(rel_diff(got.at(kv.first), kv.second), 2e-5) << what << " " << kv.first;
    };
    run_case("scatter into SHARD_GRAD_OP root-only", [&] {
      auto m2 = wrap(5, pg, ShardingStrategy::kShardGradOp, false);
      auto opt2 = make_optimizer("adam", m2);
      scatter_full_optim_state_dict(pg.rank() == 0 ? osd : OptimStateDict{}, *m2, *opt2);
      check_continues(m2, *opt2, "scatter");
    });
    run_case("shard + load into NO_SHARD, via a file", [&] {
      const std::string path = test_dir() + "/osd_rank" + std::to_string(pg.rank()) + ".pt";
      save_optim_state_dict(osd, path);
      auto reread = load_optim_state_dict_file(path);
      auto m2 = wrap(6, pg, ShardingStrategy::kNoShard, true);
      auto opt2 = make_optimizer("adam", m2);
      load_optim_state_dict(*m2, *opt2, shard_full_optim_state_dict(reread, *m2));
      check_continues(m2, *opt2, "shard");
    });
    run_case("restarted Adam is detectably different", [&] {
      auto m2 = wrap(5, pg, ShardingStrategy::kFullShard, true);
      auto opt2 = make_optimizer("adam", m2);
      load_state_dict(*m2, params_at);
      train(m2, *opt2, kSaveStep, kSteps, pg);
      auto got = full_params(m2);
      double worst = 0;
      for (const auto& kv : expected) worst = std::max(worst, rel_diff(got.at(kv.first), kv.second));
      EXPECT_GT(worst, 1e-3);
    });
  }, rank_options());
}

// Under mixed precision (bf16 compute) the FULL state dict, summon_full_params
// and checkpoints carry the fp32 master values (the shards), not bf16 copies.
TEST(StateDict, MixedPrecisionKeepsFullPrecision) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto opts = Options().auto_wrap_policy(always_wrap_policy()).mixed_precision(
        MixedPrecision().param_dtype(torch::kBFloat16));
    Model m(make_transformer(0), pg, opts);
    auto opt = make_optimizer("adam", m);
    train(m, *opt, 0, 2, pg);
    const auto sd = state_dict(*m);
    const auto pieces = sharded_state_dict(*m);  // the fp32 shards
    run_case("FULL is fp32 and equals the shards", [&] {
      for (const auto& kv : pieces) {
        const auto& full = sd[kv.key()];
        EXPECT_EQ(full.scalar_type(), torch::kFloat) << kv.key();
        EXPECT_TRUE(torch::equal(full.reshape({-1}).slice(0, kv.value().begin, kv.value().end), kv.value().local))
            << kv.key();
      }
    });
    run_case("summon shows fp32", [&] {
      SummonFullParams full(*m, SummonFullParamsOptions().writeback(false));
      for (const auto& p : m->module()->named_parameters()) {
        EXPECT_EQ(p.value().scalar_type(), torch::kFloat) << p.key();
        EXPECT_TRUE(torch::equal(p.value(), sd[p.key()])) << p.key();
      }
    });
    run_case("checkpoint into an fp32 model", [&] {
      save_checkpoint(test_dir() + "/mp", *m, opt.get());
      auto m2 = wrap(3, pg, ShardingStrategy::kFullShard, false);
      auto opt2 = make_optimizer("adam", m2);
      load_checkpoint(test_dir() + "/mp", *m2, opt2.get());
      auto sd2 = state_dict(*m2);
      for (const auto& kv : sd) EXPECT_TRUE(torch::equal(sd2[kv.key()], kv.value())) << kv.key();
    });
  }, rank_options());
}

namespace {

using TiedModel = FullyShardedDataParallel<TiedEmbeddingNetImpl>;

std::pair<torch::Tensor, torch::Tensor> tied_batch(int64_t step) {
  auto g = at::detail::createCPUGenerator(1000 + step);
  return {torch::randn({kBatch, kTiedVocab}, g), torch::randn({kBatch, kTiedVocab}, g)};
}

template <typename Fwd>
void train_tied(Fwd&& forward, torch::optim::Optimizer& opt, int64_t from, int64_t to, int rank, int world) {
  for (int64_t s = from; s < to; ++s) {
    auto [x, y] = tied_batch(s);
    opt.zero_grad(/*set_to_none=*/false);
    torch::mse_loss(forward(rank_slice(x, rank, world)), rank_slice(y, rank, world)).backward();
    opt.step();
  }
}

}  // namespace

// Tied parameters: the FULL state dict, checkpoints and their consolidation name
// the shared tensor under every name (as Python's state_dict does), and loading
// accepts either or both names. Reference: the unsharded model trained on the
// global batch.
TEST(StateDict, TiedParametersUnderEveryName) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    TiedModel m(TiedEmbeddingNet(0), pg, Options().sharding_strategy(ShardingStrategy::kFullShard));
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
    train_tied([&](const torch::Tensor& x) { return m->forward(x); }, opt, 0, 3, pg.rank(), pg.size());
    TiedEmbeddingNet ref(0);
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
    train_tied([&](const torch::Tensor& x) { return ref->forward(x); }, ref_opt, 0, 3, 0, 1);
    const auto sd = state_dict(*m);
    run_case("tied: FULL has both names, equal, matching the unsharded run", [&] {
      ASSERT_EQ(sd.size(), 4u);
      for (const char* k : {"embed.weight", "head.weight", "mid.weight", "mid.bias"}) ASSERT_NE(sd.find(k), nullptr) << k;
      EXPECT_TRUE(torch::equal(sd["embed.weight"], sd["head.weight"]));
      for (const auto& p : ref->named_parameters()) EXPECT_LT(rel_diff(sd[p.key()], p.value()), 1e-5) << p.key();
      // The reference moved away from the initial weights (the check can fail).
      EXPECT_GT(rel_diff(sd["head.weight"], TiedEmbeddingNet(0)->head->weight), 1e-3);
    });
    run_case("tied: load_state_dict with both names, with one, and with disagreeing values", [&] {
      TiedModel m2(TiedEmbeddingNet(5), pg);
      load_state_dict(*m2, sd);
      auto got = state_dict(*m2);
      for (const auto& kv : sd) EXPECT_TRUE(torch::equal(got[kv.key()], kv.value())) << kv.key();
      for (const char* only : {"embed.weight", "head.weight"}) {
        TiedModel m3(TiedEmbeddingNet(6), pg);
        StateDict one;
        for (const auto& kv : sd)
          if (kv.key() != (std::string(only) == "embed.weight" ? "head.weight" : "embed.weight"))
            one.insert(kv.key(), kv.value());
        load_state_dict(*m3, one);
        EXPECT_TRUE(torch::equal(state_dict(*m3)["head.weight"], sd["head.weight"])) << only;
      }
      StateDict bad;
      for (const auto& kv : sd) bad.insert(kv.key(), kv.key() == "head.weight" ? kv.value() + 1 : kv.value());
      TiedModel m4(TiedEmbeddingNet(7), pg);
      EXPECT_THROW(load_state_dict(*m4, bad), c10::Error);
    });
    run_case("tied: checkpoint round trip, consolidated under both names", [&] {
      const std::string dir = test_dir() + "/tied";
      save_checkpoint(dir, *m, &opt);
      {
        std::ifstream in(dir + "/metadata.json");
        std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        EXPECT_NE(text.find("\"head.weight\": \"embed.weight\""), std::string::npos) << text.substr(0, 2000);
      }
      TiedModel m2(TiedEmbeddingNet(8), pg);
      torch::optim::Adam opt2(m2->parameters(), torch::optim::AdamOptions(1e-2));
      load_checkpoint(dir, *m2, &opt2);
      auto got = state_dict(*m2);
      for (const auto& kv : sd) EXPECT_TRUE(torch::equal(got[kv.key()], kv.value())) << kv.key();
      // Continued training equals the uninterrupted run (Adam state restored).
      train_tied([&](const torch::Tensor& x) { return m->forward(x); }, opt, 3, 5, pg.rank(), pg.size());
      train_tied([&](const torch::Tensor& x) { return m2->forward(x); }, opt2, 3, 5, pg.rank(), pg.size());
      auto a = state_dict(*m), b = state_dict(*m2);
      for (const auto& kv : a) EXPECT_TRUE(torch::equal(b[kv.key()], kv.value())) << kv.key();
      if (pg.rank() == 0) {
        consolidate_checkpoint(dir, dir + ".pt");
        auto c = load_full_state_dict(dir + ".pt");
        ASSERT_EQ(c.size(), 4u);
        for (const auto& kv : sd) {
          ASSERT_NE(c.find(kv.key()), nullptr) << kv.key();
          EXPECT_TRUE(torch::equal(c[kv.key()], kv.value())) << kv.key();
        }
      }
    });
  }, rank_options());
}
