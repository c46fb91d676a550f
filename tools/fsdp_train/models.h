#pragma once
/// The three models of fsdp-train, built identically on every rank from the same seed.
///  * mlp, cnn: torch::nn::Sequential, so every entry is a wrap candidate and the size policy
///    (--min-num-params) picks the units with no code change.
///  * gpt: a decoder-only transformer whose blocks are fsdp::Wrappable members, wrapped one
///    unit per block by fsdp::module_type_policy<GptBlockImpl>() (README "Units in custom
///    models"); embeddings, final norm and head stay in the root unit.
/// Their parameter counts are checked against estimate.h's arithmetic at build time.

#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "fsdp/core/wrappable.h"

namespace fsdp::train {

/// Linear(784,H), ReLU, Linear(H,H), ReLU, Linear(H,10) on [N, 784] pixels in [0,1].
torch::nn::Sequential make_mlp(int64_t hidden);

/// On [N, 784] pixels: Unflatten to 1x28x28, Conv2d(1,16,3,pad 1), ReLU, MaxPool2d(2),
/// Conv2d(16,32,3,pad 1), ReLU, MaxPool2d(2), Flatten, Linear(32*7*7,10).
torch::nn::Sequential make_cnn();

struct GptConfig {
  int64_t vocab = 256, layers = 2, dim = 64, heads = 4, context = 64;
};

/// Causal multi-head self-attention from plain tensor ops: q, k, v projections, scores
/// q k^T / sqrt(dim/heads) with the future masked to -inf, softmax, weighted sum of v, proj.
struct CausalSelfAttentionImpl : torch::nn::Module {
  CausalSelfAttentionImpl(int64_t dim, int64_t heads);
  /// [B, T, dim] -> [B, T, dim]; position t attends to positions <= t.
  torch::Tensor forward(const torch::Tensor& x);

  int64_t heads;
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, proj{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

/// Pre-norm block: x + attn(ln1(x)), then x + fc2(gelu(fc1(ln2(x)))) with a 4*dim hidden layer.
struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(int64_t dim, int64_t heads);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& cfg);
  /// Bytes [B, T] (int64, T <= context) -> next-byte logits [B, T, vocab].
  torch::Tensor forward(const torch::Tensor& tokens);

  GptConfig cfg;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<fsdp::Wrappable<GptBlockImpl>> blocks;  ///< wrap candidates: one unit each
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace fsdp::train
