#pragma once
/// Loading a pretrained full state dict that only rank 0 can read into a sharded
/// model, unit by unit, so that no rank ever holds the whole model.
///
///     #include "fsdp/core/sharded_init.h"
///     #include "fsdp/state/rank0_load.h"
///
///     std::shared_ptr<GptImpl> gpt;
///     {
///       fsdp::ShardedInitContext sharded_init(pg, options);   // sharded as it is built
///       gpt = std::make_shared<GptImpl>(cfg);
///     }
///     auto model = fsdp::FullyShardedDataParallel(gpt, pg, options);
///     fsdp::StateDict pretrained;                        // empty on ranks != 0
///     if (pg.rank() == 0) pretrained = fsdp::map_full_state_dict("gpt.pt");
///     fsdp::load_state_dict_from_rank0(*model, pretrained);  // collective
///
/// [Note: rank-0 pretrained load]
/// Inside a ShardedInitContext a unit is sharded as soon as its Wrappable is
/// constructed, before its parent registers it, so its path in the model (the
/// state dict's key) does not exist yet: a pretrained dict keyed by paths cannot
/// be applied there (param_init_fn sees a module, not its path). It is applied
/// once FullyShardedDataParallel has adopted the units, with this rank-0-only
/// load: rank 0 checks the whole dict against the model first (every key, shape
/// and dtype, tied names equal, no unexpected key) and every rank fails with rank
/// 0's message before anything changed if it does not match; then, unit by unit,
/// rank 0 fills the unit's full flat buffer from the dict, broadcasts it, and
/// every rank copies its own pieces into its shards. Each rank holds at most one
/// unit's full flat buffer beyond its shards. Buffers, parameters outside units
/// (ignored modules) and unsharded units (NO_SHARD) are broadcast in place.
///
/// The dict on rank 0 may be an ordinary in-memory StateDict (then rank 0 holds
/// the whole model once, in the dict) or map_full_state_dict(path): tensors that
/// are views of the file's pages, read from disk only when the load copies them,
/// whose pages the load hands back to the kernel after each copy, so rank 0's
/// resident memory also stays within one unit beyond its shards.

#include <string>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/state_dict.h"

namespace fsdp {

/// A full state dict file written by torch.save(dict(model.state_dict()), path)
/// in Python, fsdp::save_full_state_dict or `fsdp-ckpt consolidate` (the zip
/// format, whose records are stored uncompressed), opened without reading its
/// tensors: each tensor is a copy-on-write view of the file's bytes (mmap), read
/// from disk when it is first touched. The file must not be changed or truncated
/// while the dict is alive. load_state_dict_from_rank0 releases a mapped tensor's
/// pages once it has copied it; reading the tensor afterwards reads the file
/// again, so changes made to a mapped tensor are lost after a load (change a
/// clone). Legacy (pre-zip, torch < 1.6) files are refused with a message.
StateDict map_full_state_dict(const std::string& path);

/// Loads `rank0_dict` (a FULL state dict: every parameter and buffer of the
/// unwrapped model under its name, full shapes, the parameters' dtype; a tied
/// parameter needs any one of its names) from rank 0 into `model`. Collective:
/// every rank calls it; the dicts of the other ranks are ignored (pass an empty
/// one). The model must be between training steps. A dict that does not match
/// the model fails on every rank, naming the key, before any value changed.
void load_state_dict_from_rank0(FullyShardedBase& model, const StateDict& rank0_dict);

}  // namespace fsdp
