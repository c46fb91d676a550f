// Hugging Face safetensors in and out (fsdp/state/safetensors.h): a file written from one
// model loads into another, unsharded or sharded at N = 3 under every strategy, with values
// equal to the writer's (bitwise; a bf16 file: the writer's values rounded to bf16); each rank
// reads only its pieces' bytes; names mapped by rename, name_map and rules (transpose, split,
// concat), tied names; sharded sets with an index; errors that list what does not match and
// fail every rank alike before anything changed. Python's safetensors against ours:
// tests/scripts/test_safetensors_interop.sh.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/state/safetensors.h"
#include "harness/error_of.h"
#include "harness/models.h"
#include "harness/multirank.h"
#include "harness/test_dir.h"
#include "state/safetensors_format.h"

using namespace fsdp;
using namespace fsdp::testing;
namespace fs = std::filesystem;
namespace st = fsdp::state::safetensors;

namespace {

using Model = FullyShardedDataParallel<TinyTransformerImpl>;

// A fresh directory under the test directory (shared with the ranks).
std::string fresh_dir(const std::string& name) {
  const std::string dir = test_dir() + "/" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::map<std::string, torch::Tensor> params_of(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

void expect_equal(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(torch::equal(got.at(name), w)) << name;
  }
}

// A safetensors file written byte by byte from `tensors` (in order), independent of the writer
// under test: the header from safetensors_format, then each tensor's bytes.
void write_file(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  std::vector<st::TensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    const auto d = t.scalar_type() == torch::kBFloat16 ? st::Dtype::BF16 : st::Dtype::F32;
    specs.push_back(st::TensorSpec{name, d, t.sizes().vec()});
  }
  std::ofstream out(path, std::ios::binary);
  out << st::serialize_header(specs);
  for (const auto& [name, t] : tensors) {
    const auto c = t.contiguous();
    out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  }
}

std::vector<std::pair<std::string, torch::Tensor>> entries_of(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value().detach());
  return out;
}

TEST(Safetensors, ModuleRoundTripAndDtypes) {
  const std::string dir = fresh_dir("module");
  auto source = make_transformer(1);
  save_safetensors(*source, dir);
  // The header says what Python's reader will see: every parameter, in F32, with its shape.
  const st::Header h = st::parse_header(dir + "/model.safetensors");
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.tensors.size(), source->named_parameters().size());
  for (const auto& t : h.tensors) EXPECT_EQ(t.dtype, st::Dtype::F32) << t.name;

  auto target = make_transformer(2);
  const SafetensorsLoadResult r = load_safetensors(*target, dir);
  expect_equal(params_of(*target), params_of(*source));
  EXPECT_TRUE(r.missing_keys.empty() && r.unexpected_keys.empty());
  int64_t total = 0;
  for (const auto& p : source->parameters()) total += p.numel() * 4;
  EXPECT_EQ(r.bytes_read, total);

  // Saved as bf16, loaded into fp32: the source's values rounded to bf16.
  const std::string bf16 = fresh_dir("module_bf16");
  save_safetensors(*source, bf16, SafetensorsSaveOptions().dtype(torch::kBFloat16));
  EXPECT_EQ(st::parse_header(bf16 + "/model.safetensors").tensors[0].dtype, st::Dtype::BF16);
  auto rounded = make_transformer(3);
  load_safetensors(*rounded, bf16);
  for (const auto& [name, v] : params_of(*source))
    EXPECT_TRUE(torch::equal(params_of(*rounded).at(name), v.to(torch::kBFloat16).to(torch::kFloat))) << name;
}

TEST(Safetensors, ShardedSetWithIndex) {
  const std::string dir = fresh_dir("set");
  auto source = make_transformer(4);
  save_safetensors(*source, dir, SafetensorsSaveOptions().max_shard_bytes(2000));
  const st::Index index = st::parse_index(dir + "/" + st::kIndexFile);
  std::set<std::string> files;
  int64_t total = 0;
  for (const auto& [name, file] : index.weight_map) files.insert(file);
  for (const auto& p : source->parameters()) total += p.numel() * 4;
  EXPECT_GT(files.size(), 2u);
  EXPECT_EQ(index.total_size, total);
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  for (const auto& f : files) {
    EXPECT_TRUE(f.rfind("model-000", 0) == 0) << f;
    EXPECT_FALSE(fs::exists(dir + "/" + f + ".tmp"));
  }
  for (const std::string& path : {dir, dir + "/" + st::kIndexFile}) {
    auto target = make_transformer(5);
    load_safetensors(*target, path);
    expect_equal(params_of(*target), params_of(*source));
  }
  // Saved again as one file: the old index goes, so the directory reads as the new file.
  auto second = make_transformer(6);
  save_safetensors(*second, dir);
  EXPECT_FALSE(fs::exists(dir + "/" + st::kIndexFile));
  auto target = make_transformer(7);
  load_safetensors(*target, dir);
  expect_equal(params_of(*target), params_of(*second));
}

// A file laid out as another codebase names and stores the same weights.
TEST(Safetensors, NamesAndRules) {
  const std::string dir = fresh_dir("rules");
  auto source = make_transformer(8);
  auto p = params_of(*source);
  std::vector<std::pair<std::string, torch::Tensor>> file;
  for (const auto& [name, v] : p) {
    if (name == "proj.weight" || name == "block0.mix.weight" || name == "block1.mix.weight" || name == "head.weight")
      continue;
    file.emplace_back("transformer." + name, v);
  }
  file.emplace_back("transformer.proj.weight_t", p.at("proj.weight").t().contiguous());  // stored [in, out]
  file.emplace_back("fused_mix", torch::cat({p.at("block0.mix.weight"), p.at("block1.mix.weight")}, 0));
  file.emplace_back("head.top", p.at("head.weight").slice(0, 0, 2).contiguous());
  file.emplace_back("head.bottom", p.at("head.weight").slice(0, 2).contiguous());
  file.emplace_back("extra.unused", torch::ones({3}));
  write_file(dir + "/model.safetensors", file);

  SafetensorsLoadOptions o;
  o.rename = [](const std::string& n) { return n.rfind("transformer.", 0) == 0 ? n.substr(12) : n; };
  o.rules = {transpose_rule("transformer.proj.weight_t", "proj.weight"),
             split_rule("fused_mix", {"block0.mix.weight", "block1.mix.weight"}),
             concat_rule({"head.top", "head.bottom"}, "head.weight")};
  // Strict: the unused tensor is named, and nothing changed.
  auto target = make_transformer(9);
  const auto before = params_of(*target);
  const std::string err = error_of([&] { load_safetensors(*target, dir, o); });
  EXPECT_NE(err.find("1 tensor(s) of the file fill nothing in the model: 'extra.unused'"), std::string::npos) << err;
  expect_equal(params_of(*target), before);
  // Left out by name_map: loads, equal to the source.
  o.name_map["extra.unused"] = "";
  load_safetensors(*target, dir, o);
  expect_equal(params_of(*target), p);

  // Without the rules: strict lists the missing model names and the unused file names.
  SafetensorsLoadOptions plain;
  plain.rename = o.rename;
  const std::string err2 = error_of([&] { load_safetensors(*target, dir, plain); });
  for (const char* name : {"'proj.weight'", "'head.weight'", "'fused_mix'", "'head.top'", "not in the file"})
    EXPECT_NE(err2.find(name), std::string::npos) << name << " in " << err2;
  plain.strict = false;
  const SafetensorsLoadResult r = load_safetensors(*target, dir, plain);
  EXPECT_EQ(r.missing_keys.size(), 4u);
  EXPECT_EQ(r.unexpected_keys.size(), 5u);

  // A shape that does not fit is named with both shapes.
  SafetensorsLoadOptions wrong = o;
  wrong.rules[0] = TensorRule{{"transformer.proj.weight_t"}, {"proj.weight"}, nullptr};
  wrong.rules[0].fn = [](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0]}; };
  const std::string err3 = error_of([&] { load_safetensors(*target, dir, wrong); });
  EXPECT_NE(err3.find("rule #0 made 'proj.weight' of shape [13, 24], the model's is [24, 13]"), std::string::npos)
      << err3;
  // Two file tensors for one parameter (not its tied names) are refused.
  SafetensorsLoadOptions twice = o;
  twice.name_map["transformer.proj.bias"] = "block0.mix.bias";
  const std::string err4 = error_of([&] { load_safetensors(*target, dir, twice); });
  EXPECT_NE(err4.find("fills 'block0.mix.bias', which tensor '"), std::string::npos) << err4;
}

TEST(Safetensors, TiedNamesAndBadInput) {
  const std::string dir = fresh_dir("tied");
  TiedEmbeddingNet source(11);
  // Our writer stores the tied weight once, under its first name.
  save_safetensors(*source, dir);
  const st::Header h = st::parse_header(dir + "/model.safetensors");
  EXPECT_EQ(h.tensors.size(), 3u);
  TiedEmbeddingNet a(12);
  load_safetensors(*a, dir);
  expect_equal(params_of(*a), params_of(*source));
  // A file with both names (as torch.save'd state dicts have) and one with the other name only.
  write_file(dir + "/both.safetensors", {{"embed.weight", source->embed->weight.detach()},
                                        {"head.weight", source->head->weight.detach()},
                                        {"mid.weight", source->mid->weight.detach()},
                                        {"mid.bias", source->mid->bias.detach()}});
  write_file(dir + "/head_only.safetensors", {{"head.weight", source->head->weight.detach()},
                                             {"mid.weight", source->mid->weight.detach()},
                                             {"mid.bias", source->mid->bias.detach()}});
  for (const char* f : {"both", "head_only"}) {
    TiedEmbeddingNet b(13);
    load_safetensors(*b, dir + "/" + f + ".safetensors");
    expect_equal(params_of(*b), params_of(*source));
    EXPECT_TRUE(b->embed->weight.is_same(b->head->weight));
  }
  // Bad input, named.
  TiedEmbeddingNet c(14);
  EXPECT_NE(error_of([&] { load_safetensors(*c, dir + "/nope.safetensors"); }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_safetensors(*c, fresh_dir("empty")); }).find("is a directory without"),
            std::string::npos);
  std::ofstream(dir + "/short.safetensors", std::ios::binary) << "\x10\0\0\0";
  EXPECT_NE(error_of([&] { load_safetensors(*c, dir + "/short.safetensors"); }).find("fsdp: safetensors: '"),
            std::string::npos);
  write_file(dir + "/bf16_shape.safetensors", {{"embed.weight", torch::zeros({6, 11}, torch::kBFloat16)}});
  SafetensorsLoadOptions loose;
  loose.strict = false;
  const std::string err = error_of([&] { load_safetensors(*c, dir + "/bf16_shape.safetensors", loose); });
  EXPECT_NE(err.find("has shape [6, 11], the model's 'embed.weight' [11, 6]"), std::string::npos) << err;
}

Model wrap(uint64_t seed, comm::ProcessGroup& pg, const std::string& how) {
  auto o = Options().auto_wrap_policy(always_wrap_policy());
  if (how == "shard_grad_op") o.sharding_strategy(ShardingStrategy::kShardGradOp);
  if (how == "no_shard") o.sharding_strategy(ShardingStrategy::kNoShard);
  if (how == "root_only") o.auto_wrap_policy(nullptr);
  if (how == "offload") o.cpu_offload(true);
  if (how == "bf16_compute") o.mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16));
  return Model(make_transformer(seed), pg, o);
}

// Each rank loads a file written from an unsharded model: values equal, read by piece.
TEST(Safetensors, LoadsIntoEveryStrategyAtThreeRanks) {
  run_ranks(3, [](comm::ProcessGroup& pg) {
    auto source = make_transformer(21);
    const std::string dir = test_dir() + "/sharded_load";
    if (pg.rank() == 0) {
      fs::remove_all(dir);
      save_safetensors(*source, dir);
      save_safetensors(*source, dir + "/bf16", SafetensorsSaveOptions().dtype(torch::kBFloat16));
    }
    comm::barrier(pg);
    int64_t total = 0;
    for (const auto& p : source->parameters()) total += p.numel() * 4;
    for (const std::string how : {"full_shard", "shard_grad_op", "no_shard", "root_only", "offload", "bf16_compute"}) {
      run_case(how, [&] {
        Model m = wrap(22, pg, how);
        const SafetensorsLoadResult r = load_safetensors(*m, dir);
        expect_equal(full_params(m), params_of(*source));
        // Sharded strategies read about a third each, every byte once over the ranks.
        auto sum = torch::tensor({r.bytes_read}, torch::kLong);
        comm::all_reduce(pg, sum).wait();
        const int64_t all = sum.item<int64_t>();
        if (how == "no_shard") {
          EXPECT_EQ(r.bytes_read, total);
        } else {
          EXPECT_EQ(all, total);
          EXPECT_LT(r.bytes_read, total / 2);
        }
        Model b = wrap(23, pg, how);
        load_safetensors(*b, dir + "/bf16");
        for (const auto& [name, v] : params_of(*source))
          EXPECT_TRUE(torch::equal(full_params(b).at(name), v.to(torch::kBFloat16).to(torch::kFloat))) << name;
      });
    }
  }, rank_options());
}

// Saved from 3 ranks, read whole by one: the FULL values; a set of files with an index.
TEST(Safetensors, SavesFromThreeRanks) {
  run_ranks(3, [](comm::ProcessGroup& pg) {
    for (const std::string how : {"full_shard", "shard_grad_op", "no_shard", "offload"}) {
      run_case(how, [&] {
        Model m = wrap(31, pg, how);
        const std::string dir = test_dir() + "/sharded_save_" + how;
        save_safetensors(*m, dir, SafetensorsSaveOptions().max_shard_bytes(how == "full_shard" ? 1500 : 0));
        const auto want = full_params(m);
        comm::barrier(pg);
        auto plain = make_transformer(32);
        load_safetensors(*plain, dir);
        expect_equal(params_of(*plain), want);
        EXPECT_EQ(fs::exists(dir + "/" + st::kIndexFile), how == "full_shard");
        comm::barrier(pg);
      });
    }
  }, rank_options());
}

// A file that does not match fails every rank with rank 0's words, before any value changed.
TEST(Safetensors, MismatchFailsEveryRankAlike) {
  run_ranks(3, [](comm::ProcessGroup& pg) {
    const std::string dir = test_dir() + "/mismatch";
    if (pg.rank() == 0) {
      fs::remove_all(dir);
      fs::create_directories(dir);
      auto source = make_transformer(41);
      std::vector<std::pair<std::string, torch::Tensor>> file = entries_of(*source);
      file.pop_back();  // head.bias
      write_file(dir + "/model.safetensors", file);
    }
    comm::barrier(pg);
    Model m = wrap(42, pg, "full_shard");
    const auto before = full_params(m);
    const std::string err = error_of([&] { load_safetensors(*m, dir); });
    EXPECT_NE(err.find("rank 0 failed: fsdp: load_safetensors: '" + dir + "': the file and the model do not match"),
              std::string::npos) << err;
    EXPECT_NE(err.find("'head.bias'"), std::string::npos) << err;
    EXPECT_NE(err.find("Nothing was loaded on any rank"), std::string::npos) << err;
    expect_equal(full_params(m), before);
  }, rank_options());
}

// SafetensorsCuda (ctest label gpu; skips without a GPU): a model on the rank's GPU loads a
// file through the pinned staging buffer (bf16 and fp32 files) and saves from device memory.
TEST(SafetensorsCuda, LoadsAndSavesAGpuModel) {
  FSDP_SKIP_WITHOUT_GPU(1);
  RankOptions ro = rank_options();
  ro.backend = comm::Backend::kNccl;
  run_ranks(1, [](comm::ProcessGroup& pg) {
    const torch::Device gpu(torch::kCUDA, pg.cuda_device());
    auto source = make_transformer(51);
    const std::string dir = fresh_dir("cuda");
    save_safetensors(*source, dir);
    save_safetensors(*source, dir + "/bf16", SafetensorsSaveOptions().dtype(torch::kBFloat16));
    for (bool offload : {false, true}) {
      run_case(offload ? "cpu_offload" : "on_gpu", [&] {
        auto net = make_transformer(52);
        net->to(gpu);
        Model m(net, pg, Options().auto_wrap_policy(always_wrap_policy()).cpu_offload(offload));
        load_safetensors(*m, dir);
        for (auto& [name, v] : full_params(m)) EXPECT_TRUE(torch::equal(v.cpu(), params_of(*source).at(name))) << name;
        load_safetensors(*m, dir + "/bf16");
        for (auto& [name, v] : full_params(m))
          EXPECT_TRUE(torch::equal(v.cpu(), params_of(*source).at(name).to(torch::kBFloat16).to(torch::kFloat)))
              << name;
        const std::string out = dir + (offload ? "/out_offload" : "/out");
        save_safetensors(*m, out);
        auto back = make_transformer(53);
        load_safetensors(*back, out);
        for (auto& [name, v] : full_params(m)) EXPECT_TRUE(torch::equal(v.cpu(), params_of(*back).at(name))) << name;
      });
    }
  }, ro);
}

}  // namespace
