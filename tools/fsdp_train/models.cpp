#include "models.h"

#include <cmath>

#include <torch/torch.h>

namespace fsdp::train {

namespace nn = torch::nn;

// Layers are appended one statement at a time: constructing them as arguments of
// Sequential's variadic constructor would draw their initial weights in the compiler's
// argument-evaluation order (right to left with GCC), not in layer order as PyTorch does.
nn::Sequential make_mlp(int64_t h) {
  nn::Sequential s;
  s->push_back(nn::Linear(28 * 28, h));
  s->push_back(nn::ReLU());
  s->push_back(nn::Linear(h, h));
  s->push_back(nn::ReLU());
  s->push_back(nn::Linear(h, 10));
  return s;
}

nn::Sequential make_cnn() {
  nn::Sequential s;
  s->push_back(nn::Unflatten(nn::UnflattenOptions(1, {1, 28, 28})));
  s->push_back(nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1)));
  s->push_back(nn::ReLU());
  s->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2)));
  s->push_back(nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1)));
  s->push_back(nn::ReLU());
  s->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2)));
  s->push_back(nn::Flatten());
  s->push_back(nn::Linear(32 * 7 * 7, 10));
  return s;
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t dim, int64_t heads_) : heads(heads_) {
  TORCH_CHECK(heads > 0 && dim % heads == 0, "fsdp-train: --dim ", dim, " must divide into --heads ", heads);
  q = register_module("q", nn::Linear(dim, dim));
  k = register_module("k", nn::Linear(dim, dim));
  v = register_module("v", nn::Linear(dim, dim));
  proj = register_module("proj", nn::Linear(dim, dim));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
  // [B, T, C] -> [B, heads, T, hd]
  auto split = [&](const torch::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
  auto qh = split(q->forward(x)), kh = split(k->forward(x)), vh = split(v->forward(x));
  auto scores = torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(double(hd));  // [B, heads, T, T]
  // Built per call rather than kept as a buffer: it depends only on T and costs T^2 bools.
  auto future = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool)).triu(1);
  auto att = torch::softmax(scores.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
  auto y = torch::matmul(att, vh).transpose(1, 2).contiguous().view({B, T, C});
  return proj->forward(y);
}

GptBlockImpl::GptBlockImpl(int64_t dim, int64_t heads) {
  ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({dim})));
  attn = register_module("attn", CausalSelfAttention(dim, heads));
  ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({dim})));
  fc1 = register_module("fc1", nn::Linear(dim, 4 * dim));
  fc2 = register_module("fc2", nn::Linear(4 * dim, dim));
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  auto h = x + attn->forward(ln1->forward(x));
  return h + fc2->forward(torch::gelu(fc1->forward(ln2->forward(h))));
}

GptImpl::GptImpl(const GptConfig& c) : cfg(c) {
  // Embedding's weight gradient is dense by default (sparse=false), which FSDP needs: a
  // sparse gradient cannot be written into the unit's flat gradient.
  tok = register_module("tok", nn::Embedding(cfg.vocab, cfg.dim));
  pos = register_module("pos", nn::Embedding(cfg.context, cfg.dim));
  for (int64_t i = 0; i < cfg.layers; ++i)
    blocks.push_back(register_module("block" + std::to_string(i), fsdp::Wrappable<GptBlockImpl>(cfg.dim, cfg.heads)));
  ln_f = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({cfg.dim})));
  head = register_module("head", nn::Linear(nn::LinearOptions(cfg.dim, cfg.vocab).bias(false)));
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  TORCH_CHECK(T <= cfg.context, "fsdp-train: gpt input of ", T, " positions exceeds --context ", cfg.context);
  auto positions = torch::arange(T, torch::TensorOptions().dtype(torch::kInt64));
  auto x = tok->forward(tokens) + pos->forward(positions);  // [B, T, dim] + [T, dim]
  for (auto& b : blocks) x = b->forward(x);
  return head->forward(ln_f->forward(x));
}

}  // namespace fsdp::train
