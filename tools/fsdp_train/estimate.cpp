#include "estimate.h"

#include "fsdp/fsdp/memory_estimate.h"

namespace fsdp::train {

int64_t mlp_num_params(int64_t h) { return 784 * h + h + h * h + h + h * 10 + 10; }

int64_t cnn_num_params() { return (16 * 1 * 9 + 16) + (32 * 16 * 9 + 32) + (32 * 7 * 7 * 10 + 10); }

int64_t gpt_num_params(int64_t layers, int64_t d, int64_t context) {
  // Per block: two LayerNorms (2d each), q, k, v, proj (d*d + d each), fc1 (d*4d + 4d), fc2 (4d*d + d).
  const int64_t block = 2 * 2 * d + 4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
  return 256 * d + context * d + layers * block + 2 * d + 256 * d;
}

int64_t model_num_params(const TrainOptions& o) {
  if (o.model == "cnn") return cnn_num_params();
  if (o.model == "gpt") return gpt_num_params(o.layers, o.dim, o.context);
  return mlp_num_params(o.hidden);
}

void format_bytes(double bytes, char* out, size_t size) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  std::snprintf(out, size, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
}

void print_memory_estimate(std::FILE* out, int64_t psi, int n) {
  struct Row {
    const char* name;
    const char* formula;
    fsdp::ShardingStrategy strategy;
  };
  const Row rows[] = {
      {"NO_SHARD", "16*P", fsdp::ShardingStrategy::NO_SHARD},
      {"SHARD_GRAD_OP", "4*P + 12*P/N", fsdp::ShardingStrategy::SHARD_GRAD_OP},
      {"FULL_SHARD", "16*P/N", fsdp::ShardingStrategy::FULL_SHARD},
  };
  std::fprintf(out, "model-state memory per rank, fp32 Adam, P = %lld parameters, N = %d ranks\n",
               (long long)psi, n);
  std::fprintf(out, "%-14s %-14s %14s %14s %14s %14s\n", "strategy", "formula", "params", "grads",
               "optim state", "total");
  for (const Row& r : rows) {
    const auto e = fsdp::estimate_model_state(psi, n, r.strategy);
    char a[32], b[32], c[32], t[32];
    format_bytes(e.param_bytes, a, sizeof(a));
    format_bytes(e.grad_bytes, b, sizeof(b));
    format_bytes(e.optim_bytes, c, sizeof(c));
    format_bytes(e.total(), t, sizeof(t));
    std::fprintf(out, "%-14s %-14s %14s %14s %14s %14s\n", r.name, r.formula, a, b, c, t);
  }
  // ZeRO without a wrapper (--strategy zero1|zero2): parameters stay replicated.
  const double p = double(psi);
  const struct {
    const char* name;
    const char* formula;
    double params, grads, optim;
  } zero_rows[] = {{"ZERO1", "8*P + 8*P/N", 4 * p, 4 * p, 8 * p / n}, {"ZERO2", "4*P + 12*P/N", 4 * p, 4 * p / n, 8 * p / n}};
  for (const auto& r : zero_rows) {
    char a[32], b[32], c[32], t[32];
    format_bytes(r.params, a, sizeof(a));
    format_bytes(r.grads, b, sizeof(b));
    format_bytes(r.optim, c, sizeof(c));
    format_bytes(r.params + r.grads + r.optim, t, sizeof(t));
    std::fprintf(out, "%-14s %-14s %14s %14s %14s %14s\n", r.name, r.formula, a, b, c, t);
  }
  std::fprintf(out, "(excludes activations, transient unsharded buffers and flat-buffer padding; "
                    "library function: fsdp::estimate_model_state)\n");
}

}  // namespace fsdp::train
