#pragma once
// Reads an optimizer archive written by torch::save(optimizer, ...) of libtorch 1.x or 2.x.
//
// The archive keys each parameter's state by the address of the parameter's TensorImpl in the
// process that saved it, and lists each group's parameters by the same keys, so state is
// matched to parameters by position in the groups. libtorch 1.x wrote the keys in hex
// ("0x55d0..."), 2.x in decimal; 2.x's own loader parses them as decimal and reads every 1.x
// key as 0, which hands all saved state to one wrong parameter. This reader accepts both.
#include <functional>
#include <memory>

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

namespace fsdp::optim::detail {

struct OptimizerArchiveReaders {
  /// One parameter's state from its archive (e.g. AdamParamState::serialize).
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>(torch::serialize::InputArchive&)> state;
  /// Group `g`'s options from its archive, applied to `opt`'s group g.
  std::function<void(size_t g, torch::serialize::InputArchive&)> options;
};

/// Replaces `opt`'s state and group options by the archive's. Checks the archive's format
/// version and that its groups have the sizes of `opt`'s, naming what differs.
void load_optimizer_archive(torch::serialize::InputArchive& archive, torch::optim::Optimizer& opt,
                            const OptimizerArchiveReaders& read);

}  // namespace fsdp::optim::detail
