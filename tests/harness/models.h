#pragma once
// Small models and training loops shared by the FSDP tests. Every parity test
// trains the same model unsharded in one process on the global batch as the
// reference (computed on every rank, from the same seed).
#include <torch/torch.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/summon_full_params.h"

namespace fsdp::testing {

/// 13-32-17-5 MLP: 1,115 parameters split 448/32/544/17/85/5, which needs
/// padding at every world size from 2 to 4.
inline torch::nn::Sequential make_mlp(uint64_t seed = 0) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(13, 32), torch::nn::ReLU(), torch::nn::Linear(32, 17),
                               torch::nn::ReLU(), torch::nn::Linear(17, 5));
}

/// A transformer-like block: pre-norm attention-free mixer + MLP (a Sequential,
/// so its layers are nested wrap candidates inside the block).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    mix = register_module("mix", torch::nn::Linear(dim, dim));
    mlp = register_module("mlp", torch::nn::Sequential(torch::nn::Linear(dim, 2 * dim + 1), torch::nn::GELU(),
                                                         torch::nn::Linear(2 * dim + 1, dim)));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + mix->forward(norm->forward(x));
    return x + mlp->forward(x);
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear mix{nullptr};
  torch::nn::Sequential mlp{nullptr};
};

/// Embedding-free "transformer": input projection, N Wrappable blocks, head.
struct TinyTransformerImpl : torch::nn::Module {
  TinyTransformerImpl(int64_t in, int64_t dim, int64_t out, int layers) {
    proj = register_module("proj", torch::nn::Linear(in, dim));
    for (int i = 0; i < layers; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), fsdp::Wrappable<BlockImpl>(dim)));
    }
    head = register_module("head", torch::nn::Linear(dim, out));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = proj->forward(x);
    for (auto& b : blocks) x = b->forward(x);
    return head->forward(x);
  }
  torch::nn::Linear proj{nullptr}, head{nullptr};
  std::vector<fsdp::Wrappable<BlockImpl>> blocks;
};
TORCH_MODULE(TinyTransformer);

inline TinyTransformer make_transformer(uint64_t seed = 0) {
  torch::manual_seed(seed);
  return TinyTransformer(13, 24, 5, 2);
}

/// A weight shared by two modules (an embedding and an output head, as in a language model
/// with tied embeddings), all in one unit.
constexpr int64_t kTiedVocab = 11, kTiedDim = 6;
struct HolderImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit HolderImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
};
TORCH_MODULE(Holder);
struct TiedEmbeddingNetImpl : torch::nn::Module {
  Holder embed{nullptr}, head{nullptr};
  torch::nn::Linear mid{nullptr};
  explicit TiedEmbeddingNetImpl(uint64_t seed) {
    torch::manual_seed(seed);
    auto w = torch::randn({kTiedVocab, kTiedDim}) * 0.4;
    embed = register_module("embed", Holder(w));
    mid = register_module("mid", torch::nn::Linear(kTiedDim, kTiedDim));
    head = register_module("head", Holder(w));  // the same tensor: tied
  }
  torch::Tensor forward(torch::Tensor x) {
    return torch::tanh(mid(x.matmul(embed->weight))).matmul(head->weight.t());
  }
};
TORCH_MODULE(TiedEmbeddingNet);

/// Deterministic global batch for step s.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step, int64_t batch, int64_t in = 13,
                                                            int64_t out = 5) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  auto x = at::randn({batch, in}, gen);
  auto y = at::randn({batch, out}, gen);
  return {x, y};
}

/// This rank's slice of a global batch.
inline torch::Tensor rank_slice(const torch::Tensor& t, int rank, int world) {
  const int64_t per = t.size(0) / world;
  return t.slice(0, rank * per, (rank + 1) * per);
}

/// Relative L2 difference.
inline double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).norm() / (b.to(torch::kDouble).norm() + 1e-30))
      .item<double>();
}

/// Full (unsharded) values of a wrapped model's parameters, by name.
template <typename Impl>
std::map<std::string, torch::Tensor> full_params(FullyShardedDataParallel<Impl>& m) {
  std::map<std::string, torch::Tensor> out;
  fsdp::apply_with_full_params(*m, [&](torch::nn::Module& mod) {
    for (const auto& p : mod.named_parameters()) out[p.key()] = p.value().detach().clone();
  });
  return out;
}

}  // namespace fsdp::testing
