// save_checkpoint and load_checkpoint of a FullyShardedDataParallel: its subject ([Note:
// checkpoint subjects] in checkpoint_subject.h) through StateView. The procedures are
// checkpoint_save.cpp and checkpoint_load.cpp.
#include "fsdp/state/checkpoint.h"

#include "async_save.h"
#include "fsdp/state/async_checkpoint.h"

#include "checkpoint_subject.h"
#include "core/state_view.h"
#include "fsdp/comm/call_label.h"

namespace fsdp {

namespace {

state::CheckpointSubject subject_of(FullyShardedBase& model, const char* what) {
  const core::detail::StateView view(model);
  return {model.process_group(), to_string(model.options().sharding_strategy()), view.local_pieces(what),
          model.module_ptr().get(), view.tracer()};
}

}  // namespace

void save_checkpoint(const std::string& dir, FullyShardedBase& model, const torch::optim::Optimizer* optimizer,
                     const CheckpointExtra& extra) {
  state::save_checkpoint_of(dir, subject_of(model, "save_checkpoint"), optimizer, extra);
}

CheckpointHandle save_checkpoint_async(const std::string& dir, FullyShardedBase& model,
                                       const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra,
                                       const AsyncCheckpointOptions& options) {
  return state::detail::save_async_of(dir, subject_of(model, "save_checkpoint_async"), optimizer, extra, options);
}

int64_t prepare_async_checkpoint(FullyShardedBase& model, const torch::optim::Optimizer* optimizer) {
  return state::detail::prepare_of(subject_of(model, "prepare_async_checkpoint"), optimizer);
}

CheckpointExtra load_checkpoint(const std::string& dir, FullyShardedBase& model, torch::optim::Optimizer* optimizer) {
  comm::LabelScope label_scope({comm::Phase::kCheckpoint, "load"});
  // Fails alike on every rank (a model inside its step), before any collective.
  return state::load_checkpoint_of(dir, subject_of(model, "load_checkpoint"), optimizer);
}

}  // namespace fsdp
