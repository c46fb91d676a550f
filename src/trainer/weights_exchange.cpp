#include "weights_exchange.h"

#include <c10/util/Exception.h>

#include <filesystem>

#include "comm/object_collectives.h"
#include "fsdp/state/dcp.h"
#include "fsdp/state/safetensors.h"

namespace fsdp::trainer::detail {

namespace weights_exchange_detail {

// Every rank's `error` (its words, "" when it succeeded): throws on every rank when any failed.
void agree(const LoopContext& ctx, const std::string& error, const char* what, const std::string& path) {
  const std::vector<std::string> errors = comm::all_gather_object(ctx.pg, error, {comm::Phase::kTrainer, what});
  for (size_t r = 0; r < errors.size(); ++r)
    TORCH_CHECK(errors[r].empty(), ctx.program(), " (rank ", ctx.rank(), "): ", what, " '", path, "' failed on rank ",
                r, ": ", errors[r]);
}

template <typename Fn>
std::string attempt(Fn&& fn) {
  try {
    fn();
    return "";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
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
  const std::string error = d::attempt([&] {
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
    error = d::attempt([&] { save_safetensors(*ctx.model.module, o.export_safetensors(), o.export_options()); });
  d::agree(ctx, error, "export_safetensors", o.export_safetensors());
}

}  // namespace fsdp::trainer::detail
