// ZeroRedundancyOptimizer: construction (flat buffer, broadcast, pieces, inner
// optimizer), step (reduce, find unused, clip, inner step, all-gather), zero_grad and
// memory accounting. The layout is zero_layout.h; stage 2's backward is
// zero_bucket_reducer.h.
#include "fsdp/optim/zero_redundancy_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <limits>
#include <numeric>
#include <unordered_map>

#include <torch/torch.h>

#include "memory/storage_alias.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/memory/optimizer_state_bytes.h"
#include "zero_bucket_reducer.h"
#include "zero_layout.h"

namespace fsdp::optim {

using detail::ZeroBucketReducer;
using detail::ZeroLayout;
using detail::ZeroPiece;

struct ZeroRedundancyOptimizer::Impl {
  ZeroOptions options;
  comm::ProcessGroup pg;
  // Trainable parameters in flat order ([Note: ZeRO partition layout]).
  std::vector<at::Tensor> params;
  std::vector<std::string> names;   // for messages
  std::vector<std::string> keys;    // module names ("" without a module)
  std::vector<int> group_of;        // index in param_groups()
  std::vector<at::Tensor> frozen;
  std::unique_ptr<ZeroLayout> layout;
  at::Tensor flat;                          // every trainable parameter views it
  at::Tensor master;                        // mixed precision: fp32 partition (pieces view it)
  std::vector<ZeroPiece> pieces;            // this rank's
  std::vector<at::Tensor> piece_tensors;    // views of `flat`, what the inner optimizer steps
  std::unique_ptr<torch::optim::Optimizer> inner;
  std::shared_ptr<ZeroBucketReducer> reducer;  // stage 2
  at::Tensor stage1_partition;               // stage 1, reduce-scatter variant, inside step()
  // Stage 1's bucket buffers, on the exchange arena: see [Note: stage 1 buckets].
  fsdp::detail::BufferPool stage1_pool{/*max_idle=*/4, /*min_block_bytes=*/0};
  std::unique_ptr<precision::DynamicGradScaler> scaler;  // dynamic_loss_scale
  double last_norm = -1;
  bool last_applied = true;

  int rank() const { return pg.rank(); }
  bool mixed() const { return master.defined(); }
  at::ScalarType comm_dtype() const {
    return options.communication_dtype().value_or(flat.scalar_type());
  }
  // dtype of reduced gradients kept for the inner optimizer (the pieces').
  at::ScalarType grad_dtype() const { return mixed() ? master.scalar_type() : flat.scalar_type(); }
  int window() const { return options.overlap_communication() ? 2 : 1; }
};

// [Note: stage 1 buckets]
// Stage 1 flattens the gradients into buckets and reduces each in place (all-reduce, or
// reduce-scatter into the partition). The buckets come from the exchange arena, so on
// one host the peers read them in place instead of through the shared-memory rings
// (the all-reduce's two ring copies of every byte become one), and from a pool that
// keeps up to four freed buffers, as stage 2 and DeepSpeed keep their reduction
// buffers: a fresh arena block would fault its pages in on every step. Under the
// all-reduce variant the gradients then alias their buckets (see done() in step()),
// so a bucket returns to the pool when zero_grad() drops them, and the pool holds it
// through the next backward: at most four buckets (reduce_bucket_size elements each,
// 4 MB by default) beyond what the step itself needs. Where glibc keeps freed memory
// ([Note: freed host memory]) it held the freed buckets for the next backward's
// gradients anyway, so the resident memory is the same. get_memory_usage() reports
// the idle buffers as MemoryCategory::kOther and empty_cache() releases them.
// bench_strategies, A/B against ordinary memory, two runs of 8 pairs: mlp zero1 step
// 0.949 and 0.946, transformer zero1 0.983 and 0.976 (docs/benchmarks.md).

namespace {

// The flat parameter buffer, zeroed, on memory the group's collectives read in place
// (comm::allocate_collective_buffer): on one host the peers copy each all-gathered chunk
// straight from it instead of through the shared-memory rings, one copy per byte
// instead of two. It lives as long as the optimizer, so the exchange arena's per-block
// cost (reserving the pages) is paid once. Elsewhere (Gloo, other devices) ordinary memory.
at::Tensor collective_zeros(const comm::ProcessGroup& pg, int64_t numel, const at::TensorOptions& o) {
  if (!o.device().is_cpu()) return at::zeros({numel}, o);
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(o.dtype()));
  c10::Storage st(c10::Storage::use_byte_size_t(), nbytes, comm::allocate_collective_buffer(pg, nbytes),
                  /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, o).set_(st, 0, {numel}, {1}).zero_();
}

void validate(const ZeroOptions& o) {
  TORCH_CHECK(o.process_group().defined(),
              "ZeroRedundancyOptimizer: ZeroOptions::process_group is not set; pass "
              "ZeroOptions().process_group(pg) with the data-parallel group "
              "(fsdp::comm::init_process_group())");
  TORCH_CHECK(o.stage() == 1 || o.stage() == 2, "ZeroRedundancyOptimizer: stage must be 1 (optimizer state "
              "sharded) or 2 (gradients sharded too), got ", o.stage());
  TORCH_CHECK(o.reduce_bucket_size() > 0, "ZeroRedundancyOptimizer: reduce_bucket_size must be > 0 elements, got ",
              o.reduce_bucket_size());
  TORCH_CHECK(std::isfinite(o.clip_grad_norm()) && o.clip_grad_norm() >= 0,
              "ZeroRedundancyOptimizer: clip_grad_norm must be a finite value >= 0 (0 turns clipping off), got ",
              o.clip_grad_norm());
  if (o.communication_dtype()) {
    const auto d = *o.communication_dtype();
    TORCH_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf || d == at::kDouble,
                "ZeroRedundancyOptimizer: communication_dtype must be float, bfloat16, half or double, got ", d);
  }
  if (o.param_dtype()) {
    const auto d = *o.param_dtype();
    TORCH_CHECK(d == at::kBFloat16 || d == at::kHalf,
                "ZeroRedundancyOptimizer: param_dtype (mixed precision) must be bfloat16 or half, got ", d,
                "; leave it unset to train in the parameters' own dtype");
  }
  TORCH_CHECK(o.gradient_accumulation_steps() >= 1,
              "ZeroRedundancyOptimizer: gradient_accumulation_steps must be >= 1, got ",
              o.gradient_accumulation_steps());
  TORCH_CHECK(!o.sync_buffers() || o.module(),
              "ZeroRedundancyOptimizer: sync_buffers needs the model: ZeroOptions().module(model.ptr())");
}

// In place from rank 0, for tensors of any layout.
void broadcast_from_rank0(const comm::ProcessGroup& pg, const at::Tensor& t) {
  if (pg.size() == 1 || !t.defined() || t.numel() == 0) return;
  at::Tensor d = t.detach();
  if (d.is_contiguous()) {
    comm::broadcast(pg, d, 0).wait();
  } else {
    at::Tensor c = d.contiguous();
    comm::broadcast(pg, c, 0).wait();
    d.copy_(c);
  }
}

void broadcast_buffers(const comm::ProcessGroup& pg, torch::nn::Module& m) {
  for (auto& b : m.buffers()) broadcast_from_rank0(pg, b);
}

// Issues one collective per bucket through `issue` (which returns its handle), keeping
// at most `window` in flight, and calls `done(b)` once bucket b's collective completed.
template <typename Issue, typename Done>
void for_each_bucket(int num_buckets, int window, Issue issue, Done done) {
  std::deque<std::pair<int, comm::CommHandle>> in_flight;
  auto retire = [&] {
    in_flight.front().second.wait();
    done(in_flight.front().first);
    in_flight.pop_front();
  };
  for (int b = 0; b < num_buckets; ++b) {
    if (static_cast<int>(in_flight.size()) >= window) retire();
    in_flight.emplace_back(b, issue(b));
  }
  while (!in_flight.empty()) retire();
}


}  // namespace

precision::DynamicGradScalerOptions ZeroOptions::low_level_zero_scaler() {
  return precision::DynamicGradScalerOptions()
      .initial_scale(65536.0)
      .growth_interval(2000)
      .max_scale(16777216.0)
      .min_scale(1.0)
      .growth_factor(2.0)
      .backoff_factor(0.5)
      .hysteresis(2);
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                                 InnerOptimizerFactory make_inner, ZeroOptions options)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<torch::optim::OptimizerOptions>()),
      impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  construct(std::move(param_groups), std::move(make_inner));
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, InnerOptimizerFactory make_inner,
                                                 ZeroOptions options)
    : ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                                  std::move(params))},
                              std::move(make_inner), std::move(options)) {}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::construct(std::vector<torch::optim::OptimizerParamGroup> groups,
                                        InnerOptimizerFactory make_inner) {
  Impl& m = *impl_;
  validate(m.options);
  m.pg = m.options.process_group();
  m.stage1_pool.set_block_allocator([g = m.pg](size_t n) { return comm::allocate_collective_buffer(g, n); });
  if (m.options.dynamic_loss_scale())
    m.scaler = std::make_unique<precision::DynamicGradScaler>(*m.options.dynamic_loss_scale());
  const int rank = m.rank(), world = m.pg.size();
  TORCH_CHECK(make_inner, "ZeroRedundancyOptimizer: the inner-optimizer factory is empty; pass e.g. "
              "fsdp::optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3))");
  torch::NoGradGuard no_grad;

  // Names and registration order from the model, when given.
  std::unordered_map<const c10::TensorImpl*, std::pair<std::string, int64_t>> known;
  if (m.options.module()) {
    int64_t k = 0;
    for (const auto& p : m.options.module()->named_parameters(/*recurse=*/true))
      known.emplace(p.value().unsafeGetTensorImpl(), std::make_pair(p.key(), k++));
  }

  struct Entry {
    at::Tensor param;
    std::string name;
    std::string key;
    int group;
    int64_t order;
  };
  std::vector<Entry> trainable;
  std::unordered_map<const c10::TensorImpl*, std::string> seen;
  int64_t appearance = static_cast<int64_t>(known.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t j = 0; j < groups[g].params().size(); ++j) {
      const at::Tensor& p = groups[g].params()[j];
      const std::string where = "param_groups[" + std::to_string(g) + "][" + std::to_string(j) + "]";
      TORCH_CHECK(p.defined(), "ZeroRedundancyOptimizer (rank ", rank, "): ", where, " is an undefined tensor");
      auto it = known.find(p.unsafeGetTensorImpl());
      const std::string name = it != known.end() ? "'" + it->second.first + "' (" + where + ")" : where;
      auto dup = seen.emplace(p.unsafeGetTensorImpl(), where);
      TORCH_CHECK(dup.second, "ZeroRedundancyOptimizer (rank ", rank, "): parameter ", name, " is also ",
                  dup.first->second, "; put each parameter in exactly one group");
      TORCH_CHECK(p.is_leaf(), "ZeroRedundancyOptimizer (rank ", rank, "): parameter ", name,
                  " is not a leaf tensor; pass the model's parameters (model->parameters())");
      if (!p.requires_grad()) {
        m.frozen.push_back(p);
        continue;
      }
      TORCH_CHECK(!p.is_sparse() && p.layout() == at::kStrided, "ZeroRedundancyOptimizer (rank ", rank,
                  "): parameter ", name, " is not a dense tensor");
      const int64_t order = it != known.end() ? it->second.second : appearance++;
      trainable.push_back({p, name, it != known.end() ? it->second.first : std::string(), static_cast<int>(g), order});
    }
  }
  // Flat order: reverse registration order, the order backward usually produces gradients.
  std::stable_sort(trainable.begin(), trainable.end(),
                   [](const Entry& a, const Entry& b) { return a.order > b.order; });
  if (!trainable.empty()) {
    const Entry& first = trainable.front();
    TORCH_CHECK(c10::isFloatingType(first.param.scalar_type()), "ZeroRedundancyOptimizer (rank ", rank,
                "): trainable parameter ", first.name, " is ", first.param.scalar_type(),
                "; only floating-point parameters can be trained");
    TORCH_CHECK(!m.options.param_dtype() || first.param.scalar_type() == at::kFloat,
                "ZeroRedundancyOptimizer (rank ", rank, "): param_dtype (mixed precision) makes fp32 master "
                "weights from the parameters, but ", first.name, " is ", first.param.scalar_type(),
                "; build the model in fp32");
    for (const Entry& e : trainable)
      TORCH_CHECK(e.param.scalar_type() == first.param.scalar_type() && e.param.device() == first.param.device(),
                  "ZeroRedundancyOptimizer (rank ", rank, "): trainable parameter ", e.name, " is ",
                  e.param.scalar_type(), " on ", e.param.device(), " but ", first.name, " is ",
                  first.param.scalar_type(), " on ", first.param.device(),
                  "; all trainable parameters share one flat buffer: give them one dtype and device "
                  "(model->to(...)) before building the optimizer");
  }

  // The flat buffer; parameters become views of it (same TensorImpls).
  std::vector<int64_t> numels;
  for (const Entry& e : trainable) {
    m.params.push_back(e.param);
    m.names.push_back(e.name);
    m.keys.push_back(e.key);
    m.group_of.push_back(e.group);
    numels.push_back(e.param.numel());
  }
  m.layout = std::make_unique<ZeroLayout>(numels, world, m.options.reduce_bucket_size());
  const auto popts = trainable.empty() ? at::TensorOptions().dtype(at::kFloat)
                                       : trainable.front().param.options().requires_grad(false);
  m.flat = collective_zeros(m.pg, m.layout->flat_numel(), popts);
  for (size_t i = 0; i < m.params.size(); ++i) {
    at::Tensor& p = m.params[i];
    const auto& slot = m.layout->params()[i];
    at::Tensor view = m.flat.narrow(0, slot.flat_offset, slot.numel);
    view.copy_(p.detach().reshape({-1}));
    p.set_data(view.view(p.sizes()));
    p.mutable_grad().reset();
  }
  // No wrapper synchronises the replicas: rank 0's values win.
  broadcast_from_rank0(m.pg, m.flat);
  for (auto& p : m.frozen) broadcast_from_rank0(m.pg, p);
  if (m.options.module()) broadcast_buffers(m.pg, *m.options.module());

  // Mixed precision: fp32 masters of this rank's chunks (from the fp32 values, before
  // rounding), then every parameter, frozen ones included, in param_dtype.
  if (m.options.param_dtype()) {
    const auto dtype = *m.options.param_dtype();
    m.master = at::empty({m.layout->partition_numel()}, m.flat.options());
    for (size_t b = 0; b < m.layout->buckets().size(); ++b) {
      const auto& lb = m.layout->buckets()[b];
      m.master.narrow(0, lb.local_offset, lb.chunk)
          .copy_(m.flat.narrow(0, m.layout->chunk_offset(static_cast<int>(b), rank), lb.chunk));
    }
    m.flat = collective_zeros(m.pg, m.flat.numel(), m.flat.options().dtype(dtype)).copy_(m.flat);
    for (size_t i = 0; i < m.params.size(); ++i) {
      const auto& slot = m.layout->params()[i];
      m.params[i].set_data(m.flat.narrow(0, slot.flat_offset, slot.numel).view(m.params[i].sizes()));
    }
    for (auto& p : m.frozen) p.set_data(p.detach().to(dtype));
  }

  // This rank's pieces, grouped as the user grouped their parameters.
  m.pieces = m.layout->pieces(rank);
  std::vector<std::vector<at::Tensor>> by_group(groups.size());
  for (const ZeroPiece& pc : m.pieces) {
    m.piece_tensors.push_back(m.mixed() ? m.master.narrow(0, pc.local_offset, pc.numel)
                                        : m.flat.narrow(0, pc.flat_offset, pc.numel));
    by_group[trainable[pc.param].group].push_back(m.piece_tensors.back());
  }
  std::vector<torch::optim::OptimizerParamGroup> inner_groups;
  for (size_t g = 0; g < groups.size(); ++g)
    inner_groups.emplace_back(by_group[g], groups[g].has_options() ? groups[g].options().clone() : nullptr);
  m.inner = make_inner(inner_groups);
  TORCH_CHECK(m.inner, "ZeroRedundancyOptimizer: the inner-optimizer factory returned null");
  TORCH_CHECK(dynamic_cast<torch::optim::LBFGS*>(m.inner.get()) == nullptr,
              "ZeroRedundancyOptimizer: LBFGS cannot be sharded: its step re-evaluates the closure and "
              "takes line-search decisions from dot products over the whole gradient and history, which "
              "no rank holds. Use LBFGS unsharded, or Adam/AdamW/SGD/fsdp::optim::CPUAdam here");
  const auto& ig = m.inner->param_groups();
  bool same = ig.size() == inner_groups.size();
  for (size_t g = 0; same && g < ig.size(); ++g) {
    same = ig[g].params().size() == inner_groups[g].params().size();
    for (size_t j = 0; same && j < ig[g].params().size(); ++j)
      same = ig[g].params()[j].is_same(inner_groups[g].params()[j]);
  }
  TORCH_CHECK(same, "ZeroRedundancyOptimizer: the inner optimizer's parameter groups are not the ",
              inner_groups.size(), " groups its factory was given; build it from exactly those groups "
              "(see fsdp::optim::inner_optimizer)");

  // This optimizer's own groups hold the user's parameters and the inner groups'
  // resolved options, which step() hands back down (LR schedulers act here).
  defaults_ = m.inner->defaults().clone();
  for (size_t g = 0; g < groups.size(); ++g)
    add_param_group_keeping_options(*this, torch::optim::OptimizerParamGroup(groups[g].params(), ig[g].options().clone()));

  if (m.options.stage() == 2) {
    ZeroBucketReducer::Config c;
    c.group = m.pg;
    c.comm_dtype = m.comm_dtype();
    c.grad_dtype = m.grad_dtype();
    c.overlap = m.options.overlap_communication();
    m.reducer = std::make_shared<ZeroBucketReducer>(m.params, m.names, *m.layout, c);
    m.reducer->install_hooks();
  }

  if (m.options.verbose() && rank == 0) {
    std::fprintf(stderr,
                 "[fsdp] ZeroRedundancyOptimizer stage %d on %d ranks: %zu trainable parameters (%lld elements), "
                 "%zu frozen, %zu buckets of <= %lld elements, flat buffer %lld, partition %lld per rank\n",
                 m.options.stage(), world, m.params.size(),
                 static_cast<long long>(std::accumulate(numels.begin(), numels.end(), int64_t{0})),
                 m.frozen.size(), m.layout->buckets().size(), static_cast<long long>(m.options.reduce_bucket_size()),
                 static_cast<long long>(m.layout->flat_numel()), static_cast<long long>(m.layout->partition_numel()));
  }
}

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  Impl& m = *impl_;
  const ZeroLayout& layout = *m.layout;
  const int nparams = static_cast<int>(m.params.size());
  const int nbuckets = static_cast<int>(layout.buckets().size());
  const bool stage2 = m.options.stage() == 2;
  const bool all_reduce_variant = !stage2 && m.options.stage1_reduction() == Stage1Reduction::kAllReduce;
  // The pieces' gradients are views of the parameters' grad() (stage 1 all-reduce in the
  // parameters' dtype), else of a partition: stage 2's, or stage 1's made in step().
  const bool grads_in_params = all_reduce_variant && !m.mixed();

  // 1. Which parameters have a gradient on this rank; stage 1 reduces now.
  std::vector<double> local(nparams + 1, 0.0);
  if (stage2) {
    if (m.reducer->in_backward()) m.reducer->finish_backward();
    for (int i = 0; i < nparams; ++i) local[i] = m.reducer->used()[i];
  } else {
    for (int i = 0; i < nparams; ++i) local[i] = m.params[i].grad().defined();
    const auto copts = m.flat.options().dtype(m.comm_dtype());
    std::vector<at::Tensor> buffers(nbuckets), outs(nbuckets);
    if (!grads_in_params)
      m.stage1_partition = at::empty({layout.partition_numel()}, m.flat.options().dtype(m.grad_dtype()));
    auto issue = [&](int b) {
      const auto& lb = layout.buckets()[b];
      if (lb.padded == 0) return comm::CommHandle();
      at::Tensor buf = m.stage1_pool.empty(lb.padded, copts);  // [Note: stage 1 buckets]
      if (lb.padded > lb.numel) buf.narrow(0, lb.numel, lb.padded - lb.numel).zero_();
      for (int i = lb.first_param; i < lb.end_param; ++i) {
        const auto& slot = layout.params()[i];
        at::Tensor dst = buf.narrow(0, slot.bucket_offset, slot.numel);
        const at::Tensor& g = m.params[i].grad();
        if (g.defined()) dst.copy_(g.reshape({-1}));
        else dst.zero_();
      }
      buffers[b] = buf;
      if (all_reduce_variant) return comm::all_reduce(m.pg, buf, comm::ReduceOp::Avg);
      at::Tensor slice = m.stage1_partition.narrow(0, lb.local_offset, lb.chunk);
      if (slice.scalar_type() == buf.scalar_type()) return comm::reduce_scatter(m.pg, slice, buf, comm::ReduceOp::Avg);
      // Reduced in the communication dtype, widened into the partition by done().
      outs[b] = at::empty({lb.chunk}, copts);
      return comm::reduce_scatter(m.pg, outs[b], buf, comm::ReduceOp::Avg);
    };
    auto done = [&](int b) {
      const auto& lb = layout.buckets()[b];
      if (all_reduce_variant && buffers[b].defined()) {
        for (int i = lb.first_param; i < lb.end_param; ++i) {
          const auto& slot = layout.params()[i];
          at::Tensor& g = m.params[i].mutable_grad();
          at::Tensor reduced = buffers[b].narrow(0, slot.bucket_offset, slot.numel).view(m.params[i].sizes());
          if (reduced.scalar_type() == m.params[i].scalar_type()) {
            // The gradient becomes its part of the reduced bucket, as under DDP's
            // gradient_as_bucket_view: no pass copying the bucket back (the step is bound
            // by passes over memory), and the gradient it replaces is freed. Contiguous, so
            // the pieces below are views of grad().
            g = fsdp::detail::storage_alias(reduced);
            continue;
          }
          // Contiguous, so that the pieces below are views of grad().
          if (!g.defined() || !g.is_contiguous()) g = at::empty_like(m.params[i], at::MemoryFormat::Contiguous);
          g.copy_(reduced);
        }
        if (m.mixed())
          m.stage1_partition.narrow(0, lb.local_offset, lb.chunk)
              .copy_(buffers[b].narrow(0, static_cast<int64_t>(m.rank()) * lb.chunk, lb.chunk));
      } else if (outs[b].defined()) {
        m.stage1_partition.narrow(0, lb.local_offset, lb.chunk).copy_(outs[b]);
      }
      buffers[b] = at::Tensor();
      outs[b] = at::Tensor();
    };
    for_each_bucket(nbuckets, m.window(), issue, done);
  }
  const at::Tensor& partition = stage2 ? m.reducer->partition() : m.stage1_partition;

  // 2. Piece gradients (views of the reduced gradients), unscaled, and their norms.
  // One all-reduce then tells every rank which parameters have a gradient anywhere
  // (the others are skipped, as torch::optim skips a parameter whose grad is undefined),
  // the global squared norm (pieces never overlap and leave out the padding, so every
  // element counts once) and whether any rank saw inf/nan.
  for (size_t k = 0; k < m.pieces.size(); ++k) {
    const ZeroPiece& pc = m.pieces[k];
    at::Tensor g;
    if (grads_in_params) {
      const at::Tensor& full = m.params[pc.param].grad();
      if (full.defined()) g = full.view({-1}).narrow(0, pc.param_offset, pc.numel);
    } else if (partition.defined()) {
      g = partition.narrow(0, pc.local_offset, pc.numel);
    }
    m.piece_tensors[k].mutable_grad() = g;
  }
  if (m.scaler && m.scaler->scale() != 1.0) {
    const double inv = 1.0 / m.scaler->scale();
    if (grads_in_params) {
      // Every rank holds the same full gradients: unscale them all, so grad() stays consistent.
      for (auto& p : m.params)
        if (p.grad().defined()) p.mutable_grad().mul_(inv);
    } else {
      for (auto& t : m.piece_tensors)
        if (t.grad().defined()) t.mutable_grad().mul_(inv);
    }
  }
  const bool clip = m.options.clip_grad_norm() > 0;
  std::vector<double> local_tail(2, 0.0);  // squared norm, found inf/nan
  if (clip || m.scaler) {
    for (auto& t : m.piece_tensors) {
      if (!t.grad().defined()) continue;
      const double norm = t.grad().norm().item<double>();  // fp32 per tensor, as clip_grad_norm_
      if (!std::isfinite(norm)) local_tail[1] = 1;
      else local_tail[0] += norm * norm;
    }
  }
  local[nparams] = local_tail[0];
  local.push_back(local_tail[1]);
  at::Tensor agreed = torch::tensor(local, at::TensorOptions().dtype(at::kDouble));
  if (m.pg.size() > 1) comm::all_reduce(m.pg, agreed, comm::ReduceOp::Sum).wait();
  auto a = agreed.accessor<double, 1>();
  for (size_t k = 0; k < m.pieces.size(); ++k)
    if (a[m.pieces[k].param] == 0) m.piece_tensors[k].mutable_grad().reset();
  if (all_reduce_variant)
    for (int i = 0; i < nparams; ++i)
      if (a[i] == 0) m.params[i].mutable_grad().reset();  // unused everywhere: stays undefined
  m.last_norm = (clip || m.scaler) ? std::sqrt(a[nparams]) : -1;

  // 3. Overflow anywhere: every rank skips (LowLevelZero: gradients discarded).
  if (m.scaler && a[nparams + 1] > 0) {
    m.last_norm = std::numeric_limits<double>::infinity();
    for (auto& t : m.piece_tensors) t.mutable_grad().reset();
    m.stage1_partition = at::Tensor();
    zero_grad(/*set_to_none=*/true);
    m.scaler->update(/*overflow=*/true);
    m.last_applied = false;
    return loss;
  }
  // Clipping, as torch::nn::utils::clip_grad_norm_.
  if (clip) {
    const double coef = m.options.clip_grad_norm() / (m.last_norm + 1e-6);
    if (coef < 1) {
      if (grads_in_params) {
        for (auto& p : m.params)
          if (p.grad().defined()) p.mutable_grad().mul_(coef);
      } else {
        for (auto& t : m.piece_tensors)
          if (t.grad().defined()) t.mutable_grad().mul_(coef);
      }
    }
  }

  // 4. Hyperparameters down (an LR scheduler may have changed ours), then the inner step.
  auto& inner_groups = m.inner->param_groups();
  for (size_t g = 0; g < param_groups_.size(); ++g) inner_groups[g].set_options(param_groups_[g].options().clone());
  m.inner->step();
  for (auto& t : m.piece_tensors) t.mutable_grad().reset();
  if (stage2) m.reducer->clear();
  m.stage1_partition = at::Tensor();

  // 5. Every rank's updated chunks, straight into the parameters' storage.
  all_gather_parameters();
  if (m.options.sync_buffers()) broadcast_buffers(m.pg, *m.options.module());
  if (m.scaler) m.scaler->update(/*overflow=*/false);
  m.last_applied = true;
  return loss;
}

void ZeroRedundancyOptimizer::all_gather_parameters() {
  torch::NoGradGuard no_grad;
  Impl& m = *impl_;
  const ZeroLayout& layout = *m.layout;
  const int nbuckets = static_cast<int>(layout.buckets().size());
  // Under mixed precision this rank's chunks are first rounded from the masters.
  if (m.mixed()) {
    for (int b = 0; b < nbuckets; ++b) {
      const auto& lb = layout.buckets()[b];
      m.flat.narrow(0, layout.chunk_offset(b, m.rank()), lb.chunk).copy_(m.master.narrow(0, lb.local_offset, lb.chunk));
    }
  }
  if (m.pg.size() == 1) return;
  auto gather = [&](int b) {
    const auto& lb = layout.buckets()[b];
    if (lb.padded == 0) return comm::CommHandle();
    return comm::all_gather_into(m.pg, m.flat.narrow(0, lb.flat_offset, lb.padded),
                                 m.flat.narrow(0, layout.chunk_offset(b, m.rank()), lb.chunk));
  };
  for_each_bucket(nbuckets, m.window(), gather, [](int) {});
}

void ZeroRedundancyOptimizer::backward(const torch::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "ZeroRedundancyOptimizer::backward (rank ", impl_->rank(),
              "): the loss must be a tensor of one element, got ", loss.defined() ? loss.sizes() : at::IntArrayRef{});
  const double factor = loss_scale() / static_cast<double>(impl_->options.gradient_accumulation_steps());
  if (factor == 1.0) loss.backward();
  else (loss * factor).backward();
}

bool ZeroRedundancyOptimizer::last_step_applied() const { return impl_->last_applied; }

double ZeroRedundancyOptimizer::loss_scale() const { return impl_->scaler ? impl_->scaler->scale() : 1.0; }

precision::GradScalerState ZeroRedundancyOptimizer::loss_scaler_state() const {
  if (impl_->scaler) return impl_->scaler->state();
  return precision::GradScalerState{};
}

void ZeroRedundancyOptimizer::load_loss_scaler_state(const precision::GradScalerState& state) {
  TORCH_CHECK(impl_->scaler, "ZeroRedundancyOptimizer: load_loss_scaler_state without dynamic_loss_scale");
  impl_->scaler->load_state(state);
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  Impl& m = *impl_;
  if (m.reducer) {
    TORCH_CHECK(!m.reducer->in_backward(), "ZeroRedundancyOptimizer (rank ", m.rank(),
                "): zero_grad during backward");
    if (set_to_none) m.reducer->clear();
    else m.reducer->zero();
  }
  torch::optim::Optimizer::zero_grad(set_to_none);
}

void ZeroRedundancyOptimizer::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, "ZeroRedundancyOptimizer: save() (torch::save) is refused: each rank's optimizer state "
              "covers only its pieces (inner()); use fsdp::consolidate_state_dict(opt, 0) and "
              "fsdp::save_optim_state_dict (include/fsdp/state/zero_state_dict.h)");
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "ZeroRedundancyOptimizer: load() (torch::load) is refused; use "
              "fsdp::load_consolidated_state_dict (include/fsdp/state/zero_state_dict.h)");
}

const ZeroOptions& ZeroRedundancyOptimizer::options() const { return impl_->options; }
torch::optim::Optimizer& ZeroRedundancyOptimizer::inner() { return *impl_->inner; }
double ZeroRedundancyOptimizer::last_grad_norm() const { return impl_->last_norm; }
int64_t ZeroRedundancyOptimizer::flat_numel() const { return impl_->layout->flat_numel(); }
int64_t ZeroRedundancyOptimizer::partition_numel() const { return impl_->layout->partition_numel(); }
int ZeroRedundancyOptimizer::num_buckets() const { return static_cast<int>(impl_->layout->buckets().size()); }

std::vector<ZeroRedundancyOptimizer::TrainableParam> ZeroRedundancyOptimizer::trainable_parameters() const {
  std::vector<TrainableParam> out;
  for (size_t i = 0; i < impl_->params.size(); ++i)
    out.push_back({impl_->keys[i], impl_->params[i], impl_->group_of[i]});
  return out;
}

std::vector<ZeroRedundancyOptimizer::LocalPiece> ZeroRedundancyOptimizer::local_pieces() const {
  std::vector<LocalPiece> out;
  for (size_t k = 0; k < impl_->pieces.size(); ++k) {
    const ZeroPiece& pc = impl_->pieces[k];
    out.push_back({pc.param, pc.param_offset, pc.numel, impl_->piece_tensors[k]});
  }
  return out;
}

MemoryUsage ZeroRedundancyOptimizer::get_memory_usage() const {
  const Impl& m = *impl_;
  MemoryUsage u;
  u.device = m.flat.device().str();
  u[MemoryCategory::kParameterShards] = static_cast<int64_t>(m.flat.nbytes());
  for (const auto& p : m.frozen) u[MemoryCategory::kParameterShards] += static_cast<int64_t>(p.nbytes());
  int64_t grads = m.reducer ? m.reducer->bytes() : 0;
  for (const auto& p : m.params)
    if (p.grad().defined()) grads += static_cast<int64_t>(p.grad().nbytes());
  if (m.stage1_partition.defined()) grads += static_cast<int64_t>(m.stage1_partition.nbytes());
  u[MemoryCategory::kGradients] = grads;
  if (m.master.defined()) u[MemoryCategory::kMasterWeights] = static_cast<int64_t>(m.master.nbytes());
  u[MemoryCategory::kOptimizerState] = memory::optimizer_state_bytes(*m.inner);
  // Freed bucket buffers kept for the next step ([Note: stage 1 buckets]).
  u[MemoryCategory::kOther] = m.stage1_pool.idle_bytes() + (m.reducer ? m.reducer->idle_bytes() : 0);
  return u;
}

void ZeroRedundancyOptimizer::empty_cache() {
  Impl& m = *impl_;
  m.stage1_pool.release_idle();
  if (m.reducer) m.reducer->release_idle();
}

}  // namespace fsdp::optim
