#pragma once
// Internal to src/optim: ZeroRedundancyOptimizer's state (its Impl) and the helpers its
// construction (zero_construction.cpp) and its step (zero_step.cpp) share. The public
// methods are in zero_redundancy_optimizer.cpp; the layout is zero_layout.h, the
// parameters' order zero_trainable.h, stage 1's reduction zero_stage1_reducer.h, stage 2's
// zero_bucket_reducer.h.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "engine/in_backward_steps.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "zero_bucket_reducer.h"
#include "zero_layout.h"
#include "zero_stage1_reducer.h"
#include "zero_trainable.h"

namespace fsdp::optim {
namespace detail {

/// What every rank learns from the one all-reduce of a step (see Impl::agree).
struct StepAgreement {
  std::vector<double> used;  ///< per parameter (flat order): > 0 when some rank has its gradient
  double norm = -1;          ///< global gradient norm, when clipping or the scaler needs it
  bool overflow = false;     ///< some rank found inf/nan
};

/// ZeroOptions checked before anything is built.
void validate(const ZeroOptions& o);
/// A flat buffer of `numel` zeros on memory the group's collectives read in place.
at::Tensor collective_zeros(const comm::ProcessGroup& pg, int64_t numel, const at::TensorOptions& o);
/// In place from rank 0, for tensors of any layout.
void broadcast_from_rank0(const comm::ProcessGroup& pg, const at::Tensor& t);
void broadcast_buffers(const comm::ProcessGroup& pg, torch::nn::Module& m);

}  // namespace detail

// The short names ZeroRedundancyOptimizer's three source files share.
using detail::broadcast_buffers;
using detail::broadcast_from_rank0;
using detail::collective_zeros;
using detail::StepAgreement;
using detail::ZeroBucketReducer;
using detail::ZeroLayout;
using detail::ZeroPiece;
using detail::ZeroStage1Reducer;
using detail::ZeroTrainable;

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
  // Where the buckets step under optimizer_in_backward ([Note: stepping in backward]): with
  // cpu_offload on a thread of their own. Last, so that it is destroyed, and its tasks
  // finished, before what they use.
  std::unique_ptr<engine::InBackwardSteps> steps;

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
    if (steps) steps->drain();
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

}  // namespace fsdp::optim
