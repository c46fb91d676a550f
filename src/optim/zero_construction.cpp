// ZeroRedundancyOptimizer's construction, in order: which parameters, the flat buffer they
// view, rank 0's values, masters, pieces and the inner optimizer, the gradient reducer.
#include <cmath>
#include <cstdio>
#include <sstream>

#include <torch/torch.h>

#include "comm/device/placement.h"
#include "comm/object_collectives.h"
#include "fsdp/comm/collectives.h"
#include "memory/host_options.h"
#include "memory/tensor_on_memory.h"
#include "zero_optimizer_impl.h"

namespace fsdp::optim {

namespace detail {

// The flat parameter buffer, zeroed, on memory the group's collectives read in place
// (comm::allocate_collective_buffer): on one host the peers copy each all-gathered chunk
// straight from it instead of through the shared-memory rings, one copy per byte
// instead of two. It lives as long as the optimizer, so the exchange arena's per-block
// cost (reserving the pages) is paid once. Elsewhere (Gloo, other devices) ordinary memory.
at::Tensor collective_zeros(const comm::ProcessGroup& pg, int64_t numel, const at::TensorOptions& o) {
  if (!o.device().is_cpu()) return at::zeros({numel}, o);
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(o.dtype()));
  return memory::tensor_on_memory(comm::allocate_collective_buffer(pg, nbytes), {numel}, o).zero_();
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
    comm::broadcast(pg, d, 0, {comm::Phase::kSetup, "ZeroRedundancyOptimizer"}).wait();
  } else {
    at::Tensor c = d.contiguous();
    comm::broadcast(pg, c, 0, {comm::Phase::kSetup, "ZeroRedundancyOptimizer"}).wait();
    d.copy_(c);
  }
}

void broadcast_buffers(const comm::ProcessGroup& pg, torch::nn::Module& m) {
  for (auto& b : m.buffers()) broadcast_from_rank0(pg, b);
}

}  // namespace detail

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

}  // namespace fsdp::optim
