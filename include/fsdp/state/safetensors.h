#pragma once
/// Weights in and out as Hugging Face safetensors: load a pretrained file (or a sharded set
/// with its model.safetensors.index.json) into a sharded model, each rank reading only the
/// bytes of its own shards; save a model's weights for Python, an inference server or the
/// next run.
///
///     fsdp::SafetensorsLoadOptions load;
///     load.rename = [](const std::string& n) { return n.rfind("transformer.", 0) == 0 ? n.substr(12) : n; };
///     fsdp::load_safetensors(*model, "gpt2/model.safetensors", load);   // collective
///     // ... train ...
///     fsdp::save_safetensors(*model, "out", fsdp::SafetensorsSaveOptions().max_shard_bytes(int64_t(5) << 30));
///
/// [Note: loading safetensors]
/// Every rank reads the file's header (the only part read in full) and matches the file's
/// names to the model's: first the rules (TensorRule: several file tensors made into several
/// model tensors by a function: a transpose, a fused qkv split, a concatenation), then each
/// remaining file name through `rename` (identity when unset) to a parameter or buffer of the
/// unwrapped model; a tied parameter accepts any of its names, and both when the file holds
/// both. What matched neither way, and what in the model nothing filled, is listed in one
/// error (strict) or returned (not strict). Shapes must be equal; dtypes are converted.
/// Then each rank reads, for each parameter, only the elements its shard holds (pread of one
/// byte range per parameter piece, straight into the shard when the dtypes match and the
/// shard is in host memory; else through a host buffer of at most 16 MiB), so no rank holds
/// more than its shards and one buffer. A rule's sources are read whole, one rule at a time:
/// transformed tensors cost their full size while they are made.
/// With a FullyShardedDataParallel model the load is collective: the ranks agree after
/// matching (a name error fails every rank before any value changed) and after reading (an
/// I/O error on one rank fails all, naming it).

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include "fsdp/core/fully_sharded.h"

namespace fsdp {

/// Some of a file's tensors (`from`, read whole, in the file's dtype, on the host) made into
/// some of the model's (`to`: parameter or buffer names of the unwrapped model) by `fn`,
/// which returns one tensor per name in `to`, of that name's shape (any dtype: converted).
struct TensorRule {
  std::vector<std::string> from;
  std::vector<std::string> to;
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> fn;
};

/// `to` = `from` transposed (GPT-2's Conv1D weights, stored [in, out], into a Linear's [out, in]).
TensorRule transpose_rule(std::string from, std::string to);
/// `from` split along `dim` into `to.size()` equal parts (a fused qkv weight into q, k, v).
TensorRule split_rule(std::string from, std::vector<std::string> to, int64_t dim = 0);
/// `from` concatenated along `dim` into `to` (separate q, k, v weights into a fused one).
TensorRule concat_rule(std::vector<std::string> from, std::string to, int64_t dim = 0);

struct SafetensorsLoadOptions {
  /// The model name of a file name no rule takes; "" leaves the file's tensor unused.
  /// Unset: the file's names are the model's.
  std::function<std::string(const std::string&)> rename;
  /// File name -> model name, consulted before `rename` ("" leaves the tensor unused).
  std::map<std::string, std::string> name_map;
  std::vector<TensorRule> rules;
  /// Unused file tensors and unfilled model tensors are an error listing them (true), or are
  /// returned in SafetensorsLoadResult (false), as torch's load_state_dict(strict).
  bool strict = true;
};

struct SafetensorsLoadResult {
  std::vector<std::string> missing_keys;     ///< model names nothing in the file filled
  std::vector<std::string> unexpected_keys;  ///< file names that filled nothing
  int64_t bytes_read = 0;                    ///< this rank's bytes read from the files
};

/// Loads `path` into `model` ([Note: loading safetensors]): a .safetensors file, a sharded
/// set's index (.json), or a directory holding model.safetensors.index.json or
/// model.safetensors. Collective; the model must be between training steps.
SafetensorsLoadResult load_safetensors(FullyShardedBase& model, const std::string& path,
                                       const SafetensorsLoadOptions& options = {});
/// The same into an unsharded module (a DDP or ZeRO-1/2 replica): every tensor whole. Not
/// collective.
SafetensorsLoadResult load_safetensors(torch::nn::Module& model, const std::string& path,
                                       const SafetensorsLoadOptions& options = {});

using SafetensorsMetadata = std::map<std::string, std::string>;

struct SafetensorsSaveOptions {
  /// Above this many bytes of tensors, a sharded set: model-00001-of-0000N.safetensors, ...
  /// and model.safetensors.index.json (a tensor larger than it gets a file of its own; a set
  /// that fits in one file is one file). 0: one file, model.safetensors.
  TORCH_ARG(int64_t, max_shard_bytes) = 0;
  /// Floating-point tensors stored in this dtype (e.g. at::kBFloat16); unset: their own.
  TORCH_ARG(std::optional<at::ScalarType>, dtype) = std::nullopt;
  /// The header's "__metadata__" (Hugging Face's loaders expect format = pt).
  TORCH_ARG(SafetensorsMetadata, metadata) = SafetensorsMetadata{{"format", "pt"}};
};

/// Writes the model's parameters (a tied parameter once, under its first name) and buffers
/// into directory `dir` (made if missing), as Python's safetensors.torch.save_model does.
/// FullyShardedDataParallel: collective; gathered unit by unit and written by rank 0 as it
/// goes, so a rank holds one unit beyond its shards. Each file is written beside its name
/// and renamed into place once durable; a sharded set's index is written last.
void save_safetensors(FullyShardedBase& model, const std::string& dir, const SafetensorsSaveOptions& options = {});
/// The same from an unsharded module. Not collective: call it on one rank.
void save_safetensors(torch::nn::Module& model, const std::string& dir, const SafetensorsSaveOptions& options = {});

}  // namespace fsdp
