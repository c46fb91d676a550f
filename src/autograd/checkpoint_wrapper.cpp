#include "fsdp/autograd/checkpoint_wrapper.h"

namespace fsdp {

int apply_activation_checkpointing(torch::nn::Module& model, const CheckpointPolicy& check_fn) {
  TORCH_CHECK(check_fn, "fsdp::apply_activation_checkpointing: empty check_fn; pass a policy such as "
              "fsdp::checkpoint_module_type<BlockImpl>()");
  int count = 0;
  for (const auto& item : model.named_modules()) {
    if (!check_fn(item.key(), *item.value())) continue;
    auto* candidate = dynamic_cast<CheckpointableBase*>(item.value().get());
    TORCH_CHECK(candidate != nullptr, "fsdp::apply_activation_checkpointing: check_fn accepts module '",
                item.key().empty() ? "<root>" : item.key(), "' (", item.value()->name(),
                "), which is no checkpoint candidate: its forward has no call site the library owns. Declare it "
                "through fsdp::Checkpointable<Impl> or fsdp::Wrappable<Impl>, or call fsdp::checkpoint inside "
                "its parent's forward");
    candidate->set_activation_checkpointed(true);
    ++count;
  }
  return count;
}

}  // namespace fsdp
