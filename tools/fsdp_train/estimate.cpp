#include "estimate.h"

#include <algorithm>
#include <vector>

#include "fsdp/core/memory_estimate.h"

namespace fsdp::train {

int64_t mlp_num_params(int64_t h) { return 784 * h + h + h * h + h + h * 10 + 10; }

int64_t cnn_num_params() { return (16 * 1 * 9 + 16) + (32 * 16 * 9 + 32) + (32 * 7 * 7 * 10 + 10); }

int64_t gpt_block_num_params(int64_t d) {
  // Two LayerNorms (2d each), q, k, v, proj (d*d + d each), fc1 (d*4d + 4d), fc2 (4d*d + d).
  return 2 * 2 * d + 4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
}

int64_t gpt_num_params(int64_t layers, int64_t d, int64_t context) {
  return 256 * d + context * d + layers * gpt_block_num_params(d) + 2 * d + 256 * d;
}

int64_t model_num_params(const TrainOptions& o) {
  if (o.model == "cnn") return cnn_num_params();
  if (o.model == "gpt") return gpt_num_params(o.layers, o.dim, o.context);
  return mlp_num_params(o.hidden);
}

void print_memory_estimate(std::FILE* out, int64_t psi, int n, bool bf16) {
  std::fprintf(out, "model-state memory per rank, fp32 Adam, P = %lld parameters, N = %d ranks%s\n", (long long)psi, n,
               bf16 ? " (bf16: the ZERO rows hold bf16 parameters and fp32 masters; FSDP keeps fp32 shards)" : "");
  std::fprintf(out, "%-14s %-14s %14s %14s %14s %14s\n", "strategy", "formula", "params", "grads",
               "optim state", "total");
  auto row = [&](const char* name, const char* formula, const fsdp::ModelStateEstimate& e) {
    char a[32], b[32], c[32], t[32];
    format_bytes(e.param_bytes, a, sizeof(a));
    format_bytes(e.grad_bytes, b, sizeof(b));
    format_bytes(e.optim_bytes, c, sizeof(c));
    format_bytes(e.total(), t, sizeof(t));
    std::fprintf(out, "%-14s %-14s %14s %14s %14s %14s\n", name, formula, a, b, c, t);
  };
  using S = fsdp::ShardingStrategy;
  row("NO_SHARD", "16*P", fsdp::estimate_model_state(psi, n, S::kNoShard));
  row("SHARD_GRAD_OP", "4*P + 12*P/N", fsdp::estimate_model_state(psi, n, S::kShardGradOp));
  row("FULL_SHARD", "16*P/N", fsdp::estimate_model_state(psi, n, S::kFullShard));
  // ZeRO without a wrapper (--strategy zero1|zero2): parameters stay replicated; under
  // --mixed-precision bf16 they are bf16 and the partition adds fp32 masters and gradients.
  const int64_t p = bf16 ? 2 : 4;
  row("ZERO1", bf16 ? "4*P + 16*P/N" : "8*P + 8*P/N", fsdp::estimate_zero_model_state(psi, n, 1, p));
  row("ZERO2", bf16 ? "2*P + 16*P/N" : "4*P + 12*P/N", fsdp::estimate_zero_model_state(psi, n, 2, p));
  std::fprintf(out, "(excludes activations, transient unsharded buffers and flat-buffer padding; "
                    "library functions: fsdp::estimate_model_state, fsdp::estimate_zero_model_state)\n");
}

void print_construction_estimate(std::FILE* out, const TrainOptions& o, int n) {
  const int64_t psi = model_num_params(o);
  char a[32], b[32], c[32], t[32];
  std::fprintf(out, "\nconstruction peak per rank (fp32 parameters as the allocator counts them; the summary's "
                    "\"build peak\" is resident memory, a few MiB more):\n");
  if (o.is_zero()) {
    format_bytes(4.0 * double(psi), a, sizeof a);
    std::fprintf(out, "  %-34s %12s  no wrapper: every rank builds the whole model (4*P)\n", o.strategy.c_str(), a);
    return;
  }
  const auto strategy = fsdp::parse_sharding_strategy(o.strategy);
  const int group = o.shard_group_size > 0 ? o.shard_group_size : n;
  // gpt: one unit per block, the rest (embeddings, final norm, head) in the root. mlp and cnn
  // are Sequentials, built whole (the size policy's units are not known here: the root bound).
  std::vector<int64_t> units;
  int64_t outside = psi;
  if (o.model == "gpt") {
    units.assign(size_t(o.layers), gpt_block_num_params(o.dim));
    outside = psi - o.layers * gpt_block_num_params(o.dim);
  }
  const auto e = fsdp::estimate_construction(units, outside, n, strategy, group);
  format_bytes(e.sharded_peak, a, sizeof a);
  format_bytes(e.eager_peak, b, sizeof b);
  format_bytes(e.after_wrap, c, sizeof c);
  if (o.model == "gpt") {
    std::fprintf(out, "  %-34s %12s  shards + the largest unit + parameters outside units (%lld blocks of "
                      "%lld, %lld outside)%s\n",
                 "sharded (ShardedInitContext, default)", a, (long long)o.layers, (long long)gpt_block_num_params(o.dim),
                 (long long)outside, o.eager_init ? "" : "  <- this run");
    std::fprintf(out, "  %-34s %12s  every parameter + the largest unit's shard%s\n", "eager (--eager-init)", b,
                 o.eager_init ? "  <- this run" : "");
  } else {
    std::fprintf(out, "  %-34s %12s  at most every parameter + its shard (%s is a Sequential, built whole)\n",
                 "eager", b, o.model.c_str());
  }
  std::fprintf(out, "  %-34s %12s  the shards\n", "after wrapping", c);
  // Training adds gradients and optimizer state (the model-state table above) and, while a
  // unit runs, its gathered parameters: with limit_all_gathers at most two units (the one
  // computing and the prefetched one) plus one unit's flat gradient before its reduction.
  const auto state = fsdp::estimate_model_state(psi, n, strategy, group);
  if (o.model == "gpt" && strategy != fsdp::ShardingStrategy::kNoShard) {
    const double largest = 4.0 * double(std::max(gpt_block_num_params(o.dim), outside));
    format_bytes(state.total() + 3 * largest, t, sizeof t);
    format_bytes(state.total(), a, sizeof a);
    std::fprintf(out, "training peak per rank, %s with fp32 Adam: model state %s + 2 gathered units + 1 unit's "
                      "gradient = %s, plus activations (not estimated)\n",
                 fsdp::to_string(strategy), a, t);
  } else {
    format_bytes(state.total(), a, sizeof a);
    std::fprintf(out, "training peak per rank, %s with fp32 Adam: model state %s plus gathered units and "
                      "activations (not estimated)\n",
                 fsdp::to_string(strategy), a);
  }
}

}  // namespace fsdp::train
