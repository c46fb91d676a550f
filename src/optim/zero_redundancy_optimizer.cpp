// ZeroRedundancyOptimizer's public methods: construction in its phases
// (zero_construction.cpp), step() in its phases (zero_step.cpp), the parameters'
// all-gather, zero_grad, memory accounting. Its state is zero_optimizer_impl.h.
#include "fsdp/optim/zero_redundancy_optimizer.h"

#include <algorithm>
#include <limits>

#include <torch/torch.h>

#include "engine/in_backward_steps.h"
#include "engine/reduction_window.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/memory/optimizer_state_bytes.h"
#include "zero_optimizer_impl.h"

namespace fsdp::optim {


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
  detail::validate(m.options);
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
    m.steps = std::make_unique<engine::InBackwardSteps>(m.offload(), m.flat.device());
  }
  if (m.options.verbose() && m.rank() == 0) m.print_layout();
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
                                 {comm::Phase::kStep, "bucket " + std::to_string(b)});
  };
  engine::for_each_bucket(nbuckets, m.window(), gather, [](int) {});
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
