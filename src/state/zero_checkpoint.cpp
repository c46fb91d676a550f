// Checkpoint directories of a ZeroRedundancyOptimizer: its pieces as a checkpoint
// subject ([Note: checkpoint subjects] in checkpoint_subject.h).
#include "fsdp/state/zero_checkpoint.h"

#include "fsdp/comm/call_label.h"

#include <unordered_map>

#include <ATen/ATen.h>

#include "async_save.h"
#include "checkpoint_subject.h"

namespace fsdp {

namespace {

using optim::ZeroRedundancyOptimizer;

// Every parameter of the optimizer's module in registration order: trainable ones as this
// rank's piece (possibly empty), the others (frozen, or not in the optimizer) whole, saved
// by rank 0 and loaded by every rank.
state::CheckpointSubject subject_of(ZeroRedundancyOptimizer& opt, const char* what) {
  const auto& module = opt.options().module();
  TORCH_CHECK(module, "fsdp::", what, ": the ZeroRedundancyOptimizer has no module; build it with "
              "ZeroOptions().module(model.ptr()) so that checkpoints name parameters and hold the buffers");
  const auto& pg = opt.options().process_group();
  const auto trainable = opt.trainable_parameters();
  const auto pieces = opt.local_pieces();
  std::unordered_map<const c10::TensorImpl*, int> index_of;  // trainable parameter -> index
  for (size_t i = 0; i < trainable.size(); ++i) index_of[trainable[i].param.unsafeGetTensorImpl()] = static_cast<int>(i);
  std::vector<int> piece_of(trainable.size(), -1);
  for (size_t k = 0; k < pieces.size(); ++k) piece_of[pieces[k].param] = static_cast<int>(k);
  // Pieces are fp32 masters under mixed precision, else views of the parameters' storage.
  const auto piece_dtype = opt.options().param_dtype() ? at::kFloat : c10::optional<at::ScalarType>();

  state::CheckpointSubject s{pg, opt.options().stage() == 1 ? "ZERO1" : "ZERO2", {}, module.get()};
  std::unordered_map<const c10::TensorImpl*, size_t> seen;  // tied parameters: one piece, more names
  for (const auto& np : module->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = np.value();
    auto dup = seen.find(p.unsafeGetTensorImpl());
    if (dup != seen.end()) {
      s.pieces[dup->second].aliases.push_back(np.key());
      continue;
    }
    seen[p.unsafeGetTensorImpl()] = s.pieces.size();
    core::detail::LocalPiece lp;
    lp.name = np.key();
    lp.shape = p.sizes().vec();
    lp.numel = p.numel();
    auto it = index_of.find(p.unsafeGetTensorImpl());
    if (it == index_of.end()) {
      lp.param = p;
      lp.begin = 0;
      lp.end = p.numel();
      lp.replicated = true;
      lp.writer = pg.rank() == 0;
    } else if (piece_of[it->second] >= 0) {
      const auto& pc = pieces[piece_of[it->second]];
      lp.param = pc.tensor;
      lp.begin = pc.offset;
      lp.end = pc.offset + pc.numel;
      lp.writer = true;  // every element has exactly one owner
    } else {
      lp.param = at::empty({0}, p.options().dtype(piece_dtype.value_or(p.scalar_type())).requires_grad(false));
    }
    s.pieces.push_back(std::move(lp));
  }
  return s;
}

}  // namespace

namespace {

// The learning rates to save are this optimizer's (an LR scheduler sets them; step() hands
// them down): hand them down now.
void hand_down_learning_rates(optim::ZeroRedundancyOptimizer& opt) {
  auto& inner = opt.inner().param_groups();
  for (size_t g = 0; g < inner.size(); ++g) inner[g].options().set_lr(opt.param_groups()[g].options().get_lr());
}

}  // namespace

void save_checkpoint(const std::string& dir, optim::ZeroRedundancyOptimizer& opt, const CheckpointExtra& extra) {
  comm::LabelScope label_scope({comm::Phase::kCheckpoint, "save"});
  auto subject = subject_of(opt, "save_checkpoint");
  hand_down_learning_rates(opt);
  state::save_checkpoint_of(dir, subject, &opt.inner(), extra);
}

int64_t prepare_async_checkpoint(optim::ZeroRedundancyOptimizer& opt) {
  return state::detail::prepare_of(subject_of(opt, "prepare_async_checkpoint"), &opt.inner());
}

CheckpointHandle save_checkpoint_async(const std::string& dir, optim::ZeroRedundancyOptimizer& opt,
                                       const CheckpointExtra& extra, const AsyncCheckpointOptions& options) {
  auto subject = subject_of(opt, "save_checkpoint_async");
  hand_down_learning_rates(opt);
  return state::detail::save_async_of(dir, subject, &opt.inner(), extra, options);
}

CheckpointExtra load_checkpoint(const std::string& dir, optim::ZeroRedundancyOptimizer& opt) {
  comm::LabelScope label_scope({comm::Phase::kCheckpoint, "load"});
  auto subject = subject_of(opt, "load_checkpoint");
  CheckpointExtra extra = state::load_checkpoint_of(dir, subject, &opt.inner());
  // Loaded into the inner groups; ours are the ones step() hands down.
  const auto& inner = opt.inner().param_groups();
  for (size_t g = 0; g < inner.size(); ++g) opt.param_groups()[g].options().set_lr(inner[g].options().get_lr());
  opt.all_gather_parameters();
  return extra;
}

}  // namespace fsdp
