// ZeroRedundancyOptimizer: construction (which parameters, the flat buffer they view,
// rank 0's values, masters, pieces and the inner optimizer, the gradient reducer) and
// step (reduce, agree, unscale/clip or skip, inner step, all-gather), zero_grad and
// memory accounting. The layout is zero_layout.h; the parameters' order
// zero_trainable.h; stage 1's reduction zero_stage1_reducer.h, stage 2's
// zero_bucket_reducer.h.
#include "fsdp/optim/zero_redundancy_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "fsdp/memory/optimizer_state_bytes.h"
#include "comm/device/placement.h"
#include "comm/object_collectives.h"
#include "zero_bucket_reducer.h"
#include "zero_bucket_window.h"
#include "memory/host_options.h"
#include "memory/host_step_queue.h"
#include "zero_layout.h"
#include "memory/placement.h"
#include "memory/param_state_key.h"
#include "memory/tensor_on_memory.h"
#include "zero_stage1_reducer.h"
#include "zero_trainable.h"

namespace fsdp::optim {

using detail::ZeroBucketReducer;
using detail::ZeroLayout;
using detail::ZeroPiece;
using detail::ZeroStage1Reducer;
using detail::ZeroTrainable;

namespace {

/// What every rank learns from the one all-reduce of a step (see Impl::agree).
struct StepAgreement {
  std::vector<double> used;  ///< per parameter (flat order): > 0 when some rank has its gradient
  double norm = -1;          ///< global gradient norm, when clipping or the scaler needs it
  bool overflow = false;     ///< some rank found inf/nan
};

}  // namespace

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
  at::Tensor master;                        // mixed precision or offload: the partition the pieces view
  at::Tensor host_grads;                    // cpu_offload: the reduced partition's host copy
  // gpu_margin_mem_ratio: buckets whose masters moved back to the device (their chunk there,
  // which the bucket's pieces view), once the first step has been placed.
  std::vector<at::Tensor> device_masters;
  bool placed = false;
  std::vector<ZeroPiece> pieces;            // this rank's
  std::vector<at::Tensor> piece_tensors;    // views of `flat`, what the inner optimizer steps
  std::unique_ptr<torch::optim::Optimizer> inner;
  std::unique_ptr<ZeroStage1Reducer> stage1;   // stage 1: gradients reduced in step()
  std::shared_ptr<ZeroBucketReducer> reducer;  // stage 2: gradients reduced during backward
  std::unique_ptr<precision::DynamicGradScaler> scaler;  // dynamic_loss_scale
  double last_norm = -1;
  bool last_applied = true;
  // ZeroOptions::optimizer_in_backward: no_step() in force; buckets stepped since step().
  bool no_step = false;
  std::vector<uint8_t> stepped;
  // With cpu_offload: the thread that steps the buckets ([Note: host steps]). Last, so that
  // it is destroyed, and its tasks finished, before what they use.
  std::unique_ptr<fsdp::detail::HostStepQueue> host_steps;

  int rank() const { return pg.rank(); }
  // The pieces view a partition of their own (fp32 masters, host copies), not `flat`.
  bool has_masters() const { return master.defined(); }
  bool offload() const { return options.cpu_offload(); }
  at::ScalarType comm_dtype() const {
    return options.communication_dtype().value_or(flat.scalar_type());
  }
  // dtype of reduced gradients kept for the inner optimizer (the pieces').
  at::ScalarType grad_dtype() const { return has_masters() ? master.scalar_type() : flat.scalar_type(); }
  int window() const { return options.overlap_communication() ? 2 : 1; }
  bool stage2() const { return options.stage() == 2; }
  bool all_reduce_variant() const {
    return !stage2() && options.stage1_reduction() == Stage1Reduction::kAllReduce;
  }
  // The pieces' gradients are views of the parameters' grad() (stage 1 all-reduce in the
  // parameters' dtype), else of a partition: stage 2's, or stage 1's made in step().
  bool grads_in_params() const { return all_reduce_variant() && !has_masters(); }
  const at::Tensor& partition() const { return stage2() ? reducer->partition() : stage1->partition(); }

  // Construction, in order.
  void take_parameters(const std::vector<torch::optim::OptimizerParamGroup>& groups);
  void check_same_parameters_on_all_ranks() const;
  void build_flat_buffer();
  void broadcast_initial_values();
  void check_same_placement_on_all_ranks() const;
  void make_masters();
  std::vector<torch::optim::OptimizerParamGroup> make_pieces(
      const std::vector<torch::optim::OptimizerParamGroup>& groups);
  void make_inner(const InnerOptimizerFactory& factory, const std::vector<torch::optim::OptimizerParamGroup>& groups);
  void make_reducer();
  void print_layout() const;

  // step(), in order.
  std::vector<double> reduce_gradients();
  void attach_piece_gradients();
  size_t bucket_of(const ZeroPiece& pc) const { return static_cast<size_t>(layout->params()[pc.param].bucket); }
  bool on_host(size_t b) const { return offload() && !device_masters[b].defined(); }
  const at::Tensor& gradient_source(size_t b, bool async = false);
  // The posted host steps have run (their errors rethrown): the inner optimizer, the pieces
  // and their gradients are this thread's again.
  void settle() {
    if (host_steps) host_steps->drain();
  }
  void scale_gradients(double factor);
  StepAgreement agree(std::vector<double> used);
  void drop_unused(const StepAgreement& agreed);
  void discard_gradients();
  void inner_step(const std::vector<torch::optim::OptimizerParamGroup>& groups);

  // The optimizer in backward ([Note: ZeRO-2 gradient buckets]).
  void step_bucket(size_t b, const std::vector<torch::optim::OptimizerParamGroup>& groups);
  std::vector<double> agree_used_in_bucket(const detail::ZeroBucket& lb);
  bool stepped_any() const;

  // gpu_margin_mem_ratio ([Note: auto placement]), at the end of the first step.
  void place_after_warmup();
  int64_t state_bytes(size_t piece) const;
  void move_bucket_to_device(size_t b);
  int64_t host_state_bytes() const;
};

namespace {

// The flat parameter buffer, zeroed, on memory the group's collectives read in place
// (comm::allocate_collective_buffer): on one host the peers copy each all-gathered chunk
// straight from it instead of through the shared-memory rings, one copy per byte
// instead of two. It lives as long as the optimizer, so the exchange arena's per-block
// cost (reserving the pages) is paid once. Elsewhere (Gloo, other devices) ordinary memory.
at::Tensor collective_zeros(const comm::ProcessGroup& pg, int64_t numel, const at::TensorOptions& o) {
  if (!o.device().is_cpu()) return at::zeros({numel}, o);
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(o.dtype()));
  return fsdp::detail::tensor_on_memory(comm::allocate_collective_buffer(pg, nbytes), {numel}, o).zero_();
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
  TORCH_CHECK(std::isfinite(o.gpu_margin_mem_ratio()) && o.gpu_margin_mem_ratio() >= 0 &&
                  o.gpu_margin_mem_ratio() <= 1,
              "ZeroRedundancyOptimizer: gpu_margin_mem_ratio must be in [0, 1], got ", o.gpu_margin_mem_ratio());
  TORCH_CHECK(o.gpu_margin_mem_ratio() == 0 || o.cpu_offload(),
              "ZeroRedundancyOptimizer: gpu_margin_mem_ratio places offloaded optimizer state back on the device, "
              "but cpu_offload is off; add cpu_offload(true) or drop gpu_margin_mem_ratio");
  if (o.optimizer_in_backward()) {
    TORCH_CHECK(o.stage() == 2, "ZeroRedundancyOptimizer: optimizer_in_backward needs stage 2 (stage 1 reduces in "
                "step(), so nothing is ready to step during backward); use stage(2)");
    TORCH_CHECK(o.clip_grad_norm() == 0 && !o.dynamic_loss_scale(), "ZeroRedundancyOptimizer: ",
                o.clip_grad_norm() != 0 ? "clip_grad_norm" : "dynamic_loss_scale (its inf/nan check)",
                " needs every gradient before any step, but optimizer_in_backward steps each bucket during "
                "backward; drop it or turn optimizer_in_backward off");
  }
}

// In place from rank 0, for tensors of any layout.
void broadcast_from_rank0(const comm::ProcessGroup& pg, const at::Tensor& t) {
  if (pg.size() == 1 || !t.defined() || t.numel() == 0) return;
  at::Tensor d = t.detach();
  if (d.is_contiguous()) {
    comm::broadcast(pg, d, 0, {comm::Phase::Setup, "ZeroRedundancyOptimizer"}).wait();
  } else {
    at::Tensor c = d.contiguous();
    comm::broadcast(pg, c, 0, {comm::Phase::Setup, "ZeroRedundancyOptimizer"}).wait();
    d.copy_(c);
  }
}

void broadcast_buffers(const comm::ProcessGroup& pg, torch::nn::Module& m) {
  for (auto& b : m.buffers()) broadcast_from_rank0(pg, b);
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

// ---- construction ---------------------------------------------------------------

void ZeroRedundancyOptimizer::construct(std::vector<torch::optim::OptimizerParamGroup> groups,
                                        InnerOptimizerFactory make_inner) {
  Impl& m = *impl_;
  validate(m.options);
  m.pg = m.options.process_group();
  if (m.options.dynamic_loss_scale())
    m.scaler = std::make_unique<precision::DynamicGradScaler>(*m.options.dynamic_loss_scale());
  TORCH_CHECK(make_inner, "ZeroRedundancyOptimizer: the inner-optimizer factory is empty; pass e.g. "
              "fsdp::optim::inner_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3))");
  torch::NoGradGuard no_grad;
  m.take_parameters(groups);
  m.check_same_parameters_on_all_ranks();
  m.check_same_placement_on_all_ranks();
  m.build_flat_buffer();
  m.broadcast_initial_values();
  if (m.options.param_dtype() || m.offload()) m.make_masters();
  m.make_inner(make_inner, m.make_pieces(groups));
  m.device_masters.resize(m.layout->buckets().size());
  // This optimizer's own groups hold the user's parameters and the inner groups'
  // resolved options, which step() hands back down (LR schedulers act here).
  defaults_ = m.inner->defaults().clone();
  const auto& ig = m.inner->param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    add_param_group_keeping_options(*this, torch::optim::OptimizerParamGroup(groups[g].params(), ig[g].options().clone()));
  m.make_reducer();
  if (m.options.optimizer_in_backward()) {
    m.stepped.assign(m.layout->buckets().size(), 0);
    m.reducer->set_on_reduced([this](size_t b) { impl_->step_bucket(b, param_groups_); });
    if (m.offload()) m.host_steps = std::make_unique<fsdp::detail::HostStepQueue>(m.flat.device());
  }
  if (m.options.verbose() && m.rank() == 0) m.print_layout();
}

/// The trainable parameters in flat order, with their names and groups; the frozen ones.
void ZeroRedundancyOptimizer::Impl::take_parameters(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  detail::ZeroParameters found =
      detail::collect_parameters(groups, options.module().get(), options.param_dtype().has_value(), rank());
  frozen = std::move(found.frozen);
  for (const ZeroTrainable& e : found.trainable) {
    params.push_back(e.param);
    names.push_back(e.name);
    keys.push_back(e.key);
    group_of.push_back(e.group);
  }
  // One device, the rank's ([Note: device placement]); the flat buffer and the reducers'
  // pools follow the parameters' device.
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (size_t i = 0; i < params.size(); ++i) named.emplace_back(names[i], params[i]);
  comm::detail::model_device(named, pg, "ZeroRedundancyOptimizer");
}

/// Before rank 0's values are broadcast into them: a rank with another model would reach
/// collectives of other sizes (a broadcast over Gloo even takes a shorter message quietly).
void ZeroRedundancyOptimizer::Impl::check_same_parameters_on_all_ranks() const {
  std::vector<std::string> lines;
  for (size_t i = 0; i < params.size(); ++i) {
    std::ostringstream os;
    os << names[i] << " " << params[i].sizes() << " " << params[i].scalar_type() << " " << params[i].device().type()
       << " in group " << group_of[i];
    lines.push_back(os.str());
  }
  comm::detail::check_same_on_all_ranks(pg, lines,
                                        {"ZeroRedundancyOptimizer", "the trainable parameters differ", "parameter",
                                         "Build the same model and parameter groups on every rank"});
}

/// The layout and the flat buffer; parameters become views of it (same TensorImpls).
void ZeroRedundancyOptimizer::Impl::build_flat_buffer() {
  std::vector<int64_t> numels;
  for (const at::Tensor& p : params) numels.push_back(p.numel());
  layout = std::make_unique<ZeroLayout>(numels, pg.size(), options.reduce_bucket_size());
  const auto popts =
      params.empty() ? at::TensorOptions().dtype(at::kFloat) : params.front().options().requires_grad(false);
  flat = collective_zeros(pg, layout->flat_numel(), popts);
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& p = params[i];
    const auto& slot = layout->params()[i];
    at::Tensor view = flat.narrow(0, slot.flat_offset, slot.numel);
    view.copy_(p.detach().reshape({-1}));
    p.set_data(view.view(p.sizes()));
    p.mutable_grad().reset();
  }
}

/// No wrapper synchronises the replicas: rank 0's values win.
void ZeroRedundancyOptimizer::Impl::broadcast_initial_values() {
  broadcast_from_rank0(pg, flat);
  for (auto& p : frozen) broadcast_from_rank0(pg, p);
  if (options.module()) broadcast_buffers(pg, *options.module());
}

/// A rank offloading while another does not would step different memories and, on a GPU,
/// all-gather from different places: refused before anything is built.
void ZeroRedundancyOptimizer::Impl::check_same_placement_on_all_ranks() const {
  comm::detail::check_same_on_all_ranks(
      pg, {std::string("cpu_offload(") + (offload() ? "true" : "false") + ")"},
      {"ZeroRedundancyOptimizer", "the placement differs", "option", "Pass the same ZeroOptions::cpu_offload on every rank"});
}

/// The masters of this rank's chunks, from the full-precision values (before rounding):
/// fp32 under mixed precision, in host memory under cpu_offload (pinned when the
/// parameters are on a GPU, so the copies each way are DMA). Then, under mixed
/// precision, every parameter, frozen ones included, in param_dtype.
void ZeroRedundancyOptimizer::Impl::make_masters() {
  auto master_options = flat.options();
  if (offload()) master_options = memory::host_options(master_options);
  master = at::empty({layout->partition_numel()}, master_options);
  for (size_t b = 0; b < layout->buckets().size(); ++b) {
    const auto& lb = layout->buckets()[b];
    master.narrow(0, lb.local_offset, lb.chunk)
        .copy_(flat.narrow(0, layout->chunk_offset(static_cast<int>(b), rank()), lb.chunk));
  }
  if (!options.param_dtype()) return;
  const auto dtype = *options.param_dtype();
  flat = collective_zeros(pg, flat.numel(), flat.options().dtype(dtype)).copy_(flat);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& slot = layout->params()[i];
    params[i].set_data(flat.narrow(0, slot.flat_offset, slot.numel).view(params[i].sizes()));
  }
  for (auto& p : frozen) p.set_data(p.detach().to(dtype));
}

/// This rank's pieces, grouped as the user grouped their parameters: the inner
/// optimizer's groups.
std::vector<torch::optim::OptimizerParamGroup> ZeroRedundancyOptimizer::Impl::make_pieces(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  pieces = layout->pieces(rank());
  std::vector<std::vector<at::Tensor>> by_group(groups.size());
  for (const ZeroPiece& pc : pieces) {
    piece_tensors.push_back(has_masters() ? master.narrow(0, pc.local_offset, pc.numel)
                                    : flat.narrow(0, pc.flat_offset, pc.numel));
    by_group[group_of[pc.param]].push_back(piece_tensors.back());
  }
  std::vector<torch::optim::OptimizerParamGroup> inner_groups;
  for (size_t g = 0; g < groups.size(); ++g)
    inner_groups.emplace_back(by_group[g], groups[g].has_options() ? groups[g].options().clone() : nullptr);
  return inner_groups;
}

void ZeroRedundancyOptimizer::Impl::make_inner(const InnerOptimizerFactory& factory,
                                               const std::vector<torch::optim::OptimizerParamGroup>& inner_groups) {
  inner = factory(inner_groups);
  TORCH_CHECK(inner, "ZeroRedundancyOptimizer: the inner-optimizer factory returned null");
  TORCH_CHECK(dynamic_cast<torch::optim::LBFGS*>(inner.get()) == nullptr,
              "ZeroRedundancyOptimizer: LBFGS cannot be sharded: its step re-evaluates the closure and "
              "takes line-search decisions from dot products over the whole gradient and history, which "
              "no rank holds. Use LBFGS unsharded, or Adam/AdamW/SGD/fsdp::optim::CPUAdam here");
  const auto& ig = inner->param_groups();
  bool same = ig.size() == inner_groups.size();
  for (size_t g = 0; same && g < ig.size(); ++g) {
    same = ig[g].params().size() == inner_groups[g].params().size();
    for (size_t j = 0; same && j < ig[g].params().size(); ++j)
      same = ig[g].params()[j].is_same(inner_groups[g].params()[j]);
  }
  TORCH_CHECK(same, "ZeroRedundancyOptimizer: the inner optimizer's parameter groups are not the ",
              inner_groups.size(), " groups its factory was given; build it from exactly those groups "
              "(see fsdp::optim::inner_optimizer)");
}

/// Stage 1 reduces in step(); stage 2 during backward, from AccumulateGrad hooks.
void ZeroRedundancyOptimizer::Impl::make_reducer() {
  if (!stage2()) {
    ZeroStage1Reducer::Config c;
    c.group = pg;
    c.comm_options = flat.options().dtype(comm_dtype());
    c.grad_options = flat.options().dtype(grad_dtype());
    c.all_reduce = all_reduce_variant();
    c.mixed = has_masters();
    c.window = window();
    stage1 = std::make_unique<ZeroStage1Reducer>(*layout, c);
    return;
  }
  ZeroBucketReducer::Config c;
  c.group = pg;
  c.comm_dtype = comm_dtype();
  c.grad_dtype = grad_dtype();
  c.overlap = options.overlap_communication();
  reducer = std::make_shared<ZeroBucketReducer>(params, names, *layout, c);
  reducer->install_hooks();
}

void ZeroRedundancyOptimizer::Impl::print_layout() const {
  int64_t elements = 0;
  for (const at::Tensor& p : params) elements += p.numel();
  std::fprintf(stderr,
               "[fsdp] ZeroRedundancyOptimizer stage %d on %d ranks: %zu trainable parameters (%lld elements), "
               "%zu frozen, %zu buckets of <= %lld elements, flat buffer %lld, partition %lld per rank\n",
               options.stage(), pg.size(), params.size(), static_cast<long long>(elements), frozen.size(),
               layout->buckets().size(), static_cast<long long>(options.reduce_bucket_size()),
               static_cast<long long>(layout->flat_numel()), static_cast<long long>(layout->partition_numel()));
}

// ---- step -----------------------------------------------------------------------

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  Impl& m = *impl_;
  if (m.options.optimizer_in_backward()) {
    // Backward stepped every bucket (finishing it steps the rest): only the all-gather is left.
    if (m.reducer->in_backward()) m.reducer->finish_backward();
    m.settle();
    if (m.stepped_any()) {
      std::fill(m.stepped.begin(), m.stepped.end(), 0);
      m.reducer->clear();
      all_gather_parameters();
      m.place_after_warmup();
      if (m.options.sync_buffers()) broadcast_buffers(m.pg, *m.options.module());
      m.last_norm = -1;
      m.last_applied = true;
      return loss;
    }
  }
  // 1. Reduce (stage 1 now; stage 2 finishes what backward left in flight).
  std::vector<double> used = m.reduce_gradients();
  // 2. The pieces' gradients, unscaled; one all-reduce for what every rank must agree on.
  m.attach_piece_gradients();
  if (m.scaler && m.scaler->scale() != 1.0) m.scale_gradients(1.0 / m.scaler->scale());
  const StepAgreement agreed = m.agree(std::move(used));
  m.drop_unused(agreed);
  m.last_norm = agreed.norm;
  // 3. Overflow anywhere: every rank skips (LowLevelZero: gradients discarded).
  if (agreed.overflow) {
    m.last_norm = std::numeric_limits<double>::infinity();
    m.discard_gradients();
    zero_grad(/*set_to_none=*/true);
    m.scaler->update(/*overflow=*/true);
    m.last_applied = false;
    return loss;
  }
  // Clipping, as torch::nn::utils::clip_grad_norm_.
  if (m.options.clip_grad_norm() > 0) {
    const double coef = m.options.clip_grad_norm() / (m.last_norm + 1e-6);
    if (coef < 1) m.scale_gradients(coef);
  }
  // 4. This rank's pieces, then 5. every rank's updated chunks into the parameters.
  m.inner_step(param_groups_);
  all_gather_parameters();
  m.place_after_warmup();
  if (m.options.sync_buffers()) broadcast_buffers(m.pg, *m.options.module());
  if (m.scaler) m.scaler->update(/*overflow=*/false);
  m.last_applied = true;
  return loss;
}

/// Which parameters have a gradient on this rank (1 or 0, flat order); stage 1 reduces
/// now, stage 2 completes its backward's reductions.
std::vector<double> ZeroRedundancyOptimizer::Impl::reduce_gradients() {
  std::vector<double> used(params.size(), 0.0);
  if (stage2()) {
    if (reducer->in_backward()) reducer->finish_backward();
    for (size_t i = 0; i < params.size(); ++i) used[i] = reducer->used()[i];
    return used;
  }
  for (size_t i = 0; i < params.size(); ++i) used[i] = params[i].grad().defined();
  stage1->reduce(params);
  return used;
}

/// Each piece's gradient: a view of the reduced gradients (of their host copy where the
/// piece is on the host under cpu_offload).
void ZeroRedundancyOptimizer::Impl::attach_piece_gradients() {
  size_t source_bucket = SIZE_MAX;
  const at::Tensor* reduced = nullptr;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ZeroPiece& pc = pieces[k];
    at::Tensor g;
    if (grads_in_params()) {
      const at::Tensor& full = params[pc.param].grad();
      if (full.defined()) g = full.view({-1}).narrow(0, pc.param_offset, pc.numel);
    } else {
      if (bucket_of(pc) != source_bucket) {  // pieces are in flat order: one source per bucket
        source_bucket = bucket_of(pc);
        reduced = &gradient_source(source_bucket);
      }
      if (reduced->defined()) g = reduced->narrow(0, pc.local_offset, pc.numel);
    }
    piece_tensors[k].mutable_grad() = g;
  }
}

/// The partition bucket b's pieces take their gradients from: the reduced partition itself,
/// or where the bucket is on the host its host copy, into which b's chunk is copied now (the
/// optimizer steps host tensors with host gradients; `async`: a copy from a GPU returns at
/// once, and an event after it says when it has landed). Undefined when nothing was reduced.
const at::Tensor& ZeroRedundancyOptimizer::Impl::gradient_source(size_t b, bool async) {
  const at::Tensor& reduced = partition();
  if (!on_host(b) || !reduced.defined()) return reduced;
  if (!host_grads.defined())
    host_grads = at::empty({layout->partition_numel()}, memory::host_options(reduced.options()));
  const auto& lb = layout->buckets()[b];
  host_grads.narrow(0, lb.local_offset, lb.chunk).copy_(reduced.narrow(0, lb.local_offset, lb.chunk), async);
  return host_grads;
}


/// Bytes of the optimizer state of piece k (0 before its first step).
int64_t ZeroRedundancyOptimizer::Impl::state_bytes(size_t k) const {
  const auto* state = memory::param_state(*inner, piece_tensors[k]);
  return state ? memory::optimizer_state_bytes(*state) : 0;
}

int64_t ZeroRedundancyOptimizer::Impl::host_state_bytes() const {
  int64_t total = 0;
  for (size_t k = 0; k < pieces.size(); ++k)
    if (on_host(bucket_of(pieces[k]))) total += state_bytes(k);
  return total;
}

/// gpu_margin_mem_ratio, after the first step: the buckets whose masters and state fit in
/// the margin move to the device ([Note: auto placement]). Once.
void ZeroRedundancyOptimizer::Impl::place_after_warmup() {
  if (placed || options.gpu_margin_mem_ratio() == 0) return;
  placed = true;
  const int64_t budget = memory::margin_budget(memory::device_memory(flat.device()), options.gpu_margin_mem_ratio());
  std::vector<int64_t> bytes(layout->buckets().size(), 0);
  for (size_t k = 0; k < pieces.size(); ++k)
    bytes[bucket_of(pieces[k])] += static_cast<int64_t>(piece_tensors[k].nbytes()) + state_bytes(k);
  const std::vector<uint8_t> chosen = memory::device_pieces(bytes, budget);
  for (size_t b = 0; b < chosen.size(); ++b)
    if (chosen[b]) move_bucket_to_device(b);
}

/// Bucket b's masters to a chunk on the device, which its pieces then view (their
/// TensorImpls, and so the optimizer's keys, stay), and their state tensors with them.
void ZeroRedundancyOptimizer::Impl::move_bucket_to_device(size_t b) {
  const auto& lb = layout->buckets()[b];
  at::Tensor chunk = at::empty({lb.chunk}, master.options().device(flat.device()));
  chunk.copy_(master.narrow(0, lb.local_offset, lb.chunk));
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ZeroPiece& pc = pieces[k];
    if (bucket_of(pc) != b) continue;
    piece_tensors[k].set_data(chunk.narrow(0, pc.local_offset - lb.local_offset, pc.numel));
    if (const auto* state = memory::param_state(*inner, piece_tensors[k]))
      memory::move_optimizer_state(*state, flat.device());
  }
  device_masters[b] = chunk;
}

/// Multiplies the gradients the step uses by `factor` (unscaling, clipping).
void ZeroRedundancyOptimizer::Impl::scale_gradients(double factor) {
  if (grads_in_params()) {
    // Every rank holds the same full gradients: scale them all, so grad() stays consistent.
    for (auto& p : params)
      if (p.grad().defined()) p.mutable_grad().mul_(factor);
  } else {
    for (auto& t : piece_tensors)
      if (t.grad().defined()) t.mutable_grad().mul_(factor);
  }
}

/// One all-reduce tells every rank which parameters have a gradient anywhere (the others
/// are skipped, as torch::optim skips a parameter whose grad is undefined), the global
/// squared norm (pieces never overlap and leave out the padding, so every element counts
/// once) and whether any rank saw inf/nan.
StepAgreement ZeroRedundancyOptimizer::Impl::agree(std::vector<double> used) {
  const size_t nparams = params.size();
  const bool need_norm = options.clip_grad_norm() > 0 || scaler;
  double squared = 0, found_nonfinite = 0;
  if (need_norm) {
    for (auto& t : piece_tensors) {
      if (!t.grad().defined()) continue;
      const double norm = t.grad().norm().item<double>();  // fp32 per tensor, as clip_grad_norm_
      if (!std::isfinite(norm)) found_nonfinite = 1;
      else squared += norm * norm;
    }
  }
  used.push_back(squared);
  used.push_back(found_nonfinite);
  at::Tensor summed = torch::tensor(used, at::TensorOptions().dtype(at::kDouble));
  if (pg.size() > 1) comm::all_reduce(pg, summed, comm::ReduceOp::Sum, {comm::Phase::Step, "agreement"}).wait();
  auto a = summed.accessor<double, 1>();
  StepAgreement agreed;
  agreed.used.assign(a.data(), a.data() + nparams);
  agreed.norm = need_norm ? std::sqrt(a[nparams]) : -1;
  agreed.overflow = scaler && a[nparams + 1] > 0;
  return agreed;
}

/// Parameters without a gradient on any rank keep none (and are not stepped).
void ZeroRedundancyOptimizer::Impl::drop_unused(const StepAgreement& agreed) {
  for (size_t k = 0; k < pieces.size(); ++k)
    if (agreed.used[pieces[k].param] == 0) piece_tensors[k].mutable_grad().reset();
  if (all_reduce_variant())
    for (size_t i = 0; i < params.size(); ++i)
      if (agreed.used[i] == 0) params[i].mutable_grad().reset();  // unused everywhere: stays undefined
}

/// A skipped step's gradients go (the parameters' own with zero_grad).
void ZeroRedundancyOptimizer::Impl::discard_gradients() {
  for (auto& t : piece_tensors) t.mutable_grad().reset();
  if (stage1) stage1->clear();
}

/// Hyperparameters down (an LR scheduler may have changed ours), then the inner step;
/// the reduced gradients are consumed.
void ZeroRedundancyOptimizer::Impl::inner_step(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  auto& inner_groups = inner->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) inner_groups[g].set_options(groups[g].options().clone());
  inner->step();
  for (auto& t : piece_tensors) t.mutable_grad().reset();
  if (stage2()) reducer->clear();
  else stage1->clear();
}

bool ZeroRedundancyOptimizer::Impl::stepped_any() const {
  return std::find(stepped.begin(), stepped.end(), 1) != stepped.end();
}

/// Which of the bucket's parameters have a gradient on some rank (step()'s agreement, for
/// one bucket); every rank completes its buckets in the same order, so these all-reduces match.
std::vector<double> ZeroRedundancyOptimizer::Impl::agree_used_in_bucket(const detail::ZeroBucket& lb) {
  std::vector<double> used(reducer->used().begin() + lb.first_param, reducer->used().begin() + lb.end_param);
  if (pg.size() == 1 || used.empty()) return used;
  at::Tensor summed = torch::tensor(used, at::TensorOptions().dtype(at::kDouble));
  comm::all_reduce(pg, summed, comm::ReduceOp::Sum, {comm::Phase::Backward, "bucket used"}).wait();
  auto a = summed.accessor<double, 1>();
  return std::vector<double>(a.data(), a.data() + used.size());
}

/// ZeroOptions::optimizer_in_backward: bucket b's chunk is complete; its pieces are
/// stepped as step() would step them (the parameters used nowhere skipped), then the
/// chunk is consumed. Only this bucket's pieces have a gradient during the step.
void ZeroRedundancyOptimizer::Impl::step_bucket(size_t b,
                                                const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  if (no_step) return;
  TORCH_CHECK(!stepped[b], "ZeroRedundancyOptimizer (rank ", rank(), "): a second backward would step bucket ", b,
              " before step() all-gathered the parameters the first one stepped; under optimizer_in_backward call "
              "step() after every backward, and wrap the micro-batches but the last of an accumulation in no_step()");
  torch::NoGradGuard no_grad;
  const detail::ZeroBucket& lb = layout->buckets()[b];
  const std::vector<double> used = agree_used_in_bucket(lb);
  std::vector<size_t> mine;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const ZeroPiece& pc = pieces[k];
    if (pc.param >= lb.first_param && pc.param < lb.end_param && used[pc.param - lb.first_param] != 0)
      mine.push_back(k);
  }
  const bool on_thread = host_steps != nullptr;
  at::Tensor reduced = gradient_source(b, /*async=*/on_thread);
  std::shared_ptr<c10::Event> landed =
      on_thread && on_host(b) && reduced.defined() ? fsdp::detail::event_after_queued_work(partition().device()) : nullptr;
  auto step = [this, mine, reduced, landed, groups = &groups] {
    if (landed) landed->synchronize();
    for (size_t k : mine) piece_tensors[k].mutable_grad() = reduced.narrow(0, pieces[k].local_offset, pieces[k].numel);
    auto& inner_groups = inner->param_groups();
    for (size_t g = 0; g < groups->size(); ++g) inner_groups[g].set_options((*groups)[g].options().clone());
    inner->step();
    for (size_t k : mine) piece_tensors[k].mutable_grad().reset();
  };
  if (on_thread) host_steps->post(std::move(step));
  else step();
  reducer->consume(b);
  stepped[b] = 1;
}

ZeroRedundancyOptimizer::NoStepGuard::NoStepGuard(ZeroRedundancyOptimizer* opt)
    : opt_(opt), previous_(opt->impl_->no_step) {
  TORCH_CHECK(opt->impl_->options.optimizer_in_backward(), "ZeroRedundancyOptimizer (rank ", opt->impl_->rank(),
              "): no_step() holds back the step in backward, which only ZeroOptions::optimizer_in_backward(true) "
              "takes; without it backward never steps");
  opt_->impl_->no_step = true;
}
ZeroRedundancyOptimizer::NoStepGuard::~NoStepGuard() {
  if (opt_) opt_->impl_->no_step = previous_;
}

void ZeroRedundancyOptimizer::all_gather_parameters() {
  torch::NoGradGuard no_grad;
  Impl& m = *impl_;
  m.settle();
  const ZeroLayout& layout = *m.layout;
  const int nbuckets = static_cast<int>(layout.buckets().size());
  // This rank's chunks first come from the masters: rounded under mixed precision, copied
  // from the host under cpu_offload.
  if (m.has_masters()) {
    for (int b = 0; b < nbuckets; ++b) {
      const auto& lb = layout.buckets()[b];
      const at::Tensor& from = m.device_masters[b].defined() ? m.device_masters[b]
                                                             : m.master.narrow(0, lb.local_offset, lb.chunk);
      m.flat.narrow(0, layout.chunk_offset(b, m.rank()), lb.chunk).copy_(from);
    }
  }
  if (m.pg.size() == 1) return;
  auto gather = [&](int b) {
    const auto& lb = layout.buckets()[b];
    if (lb.padded == 0) return comm::CommHandle();
    return comm::all_gather_into(m.pg, m.flat.narrow(0, lb.flat_offset, lb.padded),
                                 m.flat.narrow(0, layout.chunk_offset(b, m.rank()), lb.chunk),
                                 {comm::Phase::Step, "bucket " + std::to_string(b)});
  };
  detail::for_each_bucket(nbuckets, m.window(), gather, [](int) {});
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
  m.settle();
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
torch::optim::Optimizer& ZeroRedundancyOptimizer::inner() {
  impl_->settle();
  return *impl_->inner;
}
double ZeroRedundancyOptimizer::last_grad_norm() const { return impl_->last_norm; }
int64_t ZeroRedundancyOptimizer::flat_numel() const { return impl_->layout->flat_numel(); }
int64_t ZeroRedundancyOptimizer::partition_numel() const { return impl_->layout->partition_numel(); }
int ZeroRedundancyOptimizer::num_buckets() const { return static_cast<int>(impl_->layout->buckets().size()); }
int ZeroRedundancyOptimizer::num_buckets_on_device() const {
  return static_cast<int>(std::count_if(impl_->device_masters.begin(), impl_->device_masters.end(),
                                        [](const at::Tensor& t) { return t.defined(); }));
}

std::vector<ZeroRedundancyOptimizer::TrainableParam> ZeroRedundancyOptimizer::trainable_parameters() const {
  std::vector<TrainableParam> out;
  for (size_t i = 0; i < impl_->params.size(); ++i)
    out.push_back({impl_->keys[i], impl_->params[i], impl_->group_of[i]});
  return out;
}

std::vector<ZeroRedundancyOptimizer::LocalPiece> ZeroRedundancyOptimizer::local_pieces() const {
  impl_->settle();
  std::vector<LocalPiece> out;
  for (size_t k = 0; k < impl_->pieces.size(); ++k) {
    const ZeroPiece& pc = impl_->pieces[k];
    out.push_back({pc.param, pc.param_offset, pc.numel, impl_->piece_tensors[k]});
  }
  return out;
}

MemoryUsage ZeroRedundancyOptimizer::get_memory_usage() const {
  impl_->settle();
  const Impl& m = *impl_;
  MemoryUsage u;
  u.device = m.flat.device().str();
  u[MemoryCategory::kParameterShards] = static_cast<int64_t>(m.flat.nbytes());
  for (const auto& p : m.frozen) u[MemoryCategory::kParameterShards] += static_cast<int64_t>(p.nbytes());
  int64_t grads = m.reducer ? m.reducer->bytes() : 0;
  for (const auto& p : m.params)
    if (p.grad().defined()) grads += static_cast<int64_t>(p.grad().nbytes());
  if (m.stage1) grads += m.stage1->bytes();
  u[MemoryCategory::kGradients] = grads;
  const int64_t host_masters = m.master.defined() ? static_cast<int64_t>(m.master.nbytes()) : 0;
  u[MemoryCategory::kMasterWeights] = host_masters;
  for (const auto& chunk : m.device_masters)
    if (chunk.defined()) u[MemoryCategory::kMasterWeights] += static_cast<int64_t>(chunk.nbytes());
  u[MemoryCategory::kOptimizerState] = memory::optimizer_state_bytes(*m.inner);
  if (m.offload()) {
    // The host partition stays allocated whole: buckets moved to the device leave their range unused.
    const int64_t host_grads = m.host_grads.defined() ? static_cast<int64_t>(m.host_grads.nbytes()) : 0;
    u[MemoryCategory::kGradients] += host_grads;
    u.offloaded_bytes = host_masters + m.host_state_bytes() + host_grads;
  }
  // Freed bucket buffers kept for the next step ([Note: stage 1 buckets] in zero_stage1_reducer.h).
  u[MemoryCategory::kOther] = (m.stage1 ? m.stage1->idle_bytes() : 0) + (m.reducer ? m.reducer->idle_bytes() : 0);
  return u;
}

void ZeroRedundancyOptimizer::empty_cache() {
  Impl& m = *impl_;
  if (m.stage1) m.stage1->release_idle();
  if (m.reducer) m.reducer->release_idle();
}

}  // namespace fsdp::optim
