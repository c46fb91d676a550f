#include "weights_exchange.h"

#include <filesystem>

#include "fsdp/state/dcp.h"
#include "fsdp/state/safetensors.h"
#include "state/agreed_failure.h"
#include "state/error_message.h"

namespace fsdp::trainer::detail {

namespace weights_exchange_detail {

void agree(const LoopContext& ctx, const std::string& error, const char* what, const std::string& path) {
  state::throw_if_any_failed(ctx.pg, error, std::string(ctx.program()) + ": " + what + " '" + path + "'",
                             "Every rank stopped");
}

}  // namespace weights_exchange_detail

void load_initial_weights(const LoopContext& ctx) {
  namespace d = weights_exchange_detail;
  const TrainerOptions& o = ctx.options;
  // A directory with a .metadata is a PyTorch Distributed Checkpoint: its "model" weights.
  const bool is_dcp = std::filesystem::exists(o.init_from() + "/.metadata");
  if (ctx.model.fsdp) {
    // Collective, agreed inside.
    if (is_dcp) load_dcp(*ctx.model.fsdp, nullptr, o.init_from());
    else load_safetensors(*ctx.model.fsdp, o.init_from(), o.init_options());
    return;
  }
  const std::string error = state::failure_of([&] {
    if (is_dcp) load_dcp(*ctx.model.module, nullptr, o.init_from());
    else load_safetensors(*ctx.model.module, o.init_from(), o.init_options());
  });
  d::agree(ctx, error, "init_from", o.init_from());
}

void export_weights(const LoopContext& ctx) {
  namespace d = weights_exchange_detail;
  const TrainerOptions& o = ctx.options;
  if (ctx.model.fsdp) {
    save_safetensors(*ctx.model.fsdp, o.export_safetensors(), o.export_options());  // collective
    return;
  }
  std::string error;
  if (ctx.lead())
    error = state::failure_of([&] { save_safetensors(*ctx.model.module, o.export_safetensors(), o.export_options()); });
  d::agree(ctx, error, "export_safetensors", o.export_safetensors());
}

}  // namespace fsdp::trainer::detail
