#pragma once
// PyTorch Distributed Checkpoint (DCP) metadata, typed and without torch: the `.metadata`
// file of a DCP checkpoint read into plain structs, and those structs written back as the
// pickle Python's DCP writer would write. The torch side (reading the `.distcp` chunks,
// loading them into sharded models, writing checkpoints) is built on these.
//
// [Note: DCP metadata]
// A DCP checkpoint is a directory: each rank's `.distcp` files hold what it saved, each
// tensor chunk and each non-tensor value a torch.save of its own, and `.metadata`, written
// by the coordinator, says where everything is. It is pickle.dump (protocol 4 up to
// Python 3.13) of a torch.distributed.checkpoint.metadata.Metadata dataclass:
//   state_dict_metadata  {fqn: TensorStorageMetadata | BytesStorageMetadata}, the flattened
//                        state dict's keys in the order the ranks' plans listed them: rank
//                        0's items, then each later rank's items that no earlier rank had.
//                        TensorStorageMetadata(properties, size, chunks): the global shape
//                        (a torch.Size), a TensorProperties (pickled by its __getstate__ as
//                        (dtype, layout, requires_grad, memory-format code, pin_memory)), and
//                        one ChunkStorageMetadata(offsets, sizes) per saved box, in rank order.
//   planner_data         {fqn: path}, where the flattened key sat in the nested state dict:
//                        a tuple of str keys and int list indexes, ('optim', 'param_groups',
//                        0, 'lr'); in the order the last rank's state dict was flattened.
//   storage_data         {MetadataIndex(fqn, offset, index): _StorageInfo(relative_path,
//                        offset, length[, transform_descriptors])}: where each chunk's bytes
//                        lie. A tensor chunk's key is its fqn and its offsets (index is only
//                        a hint: the chunk's position in `chunks`); a non-tensor's key has no
//                        offset, and index None. In the order the ranks reported their writes:
//                        rank by rank, each rank's files in order, each file by offset.
//   storage_meta         StorageMeta(checkpoint_id, save_id, load_id, modules) or None;
//                        FileSystemWriter records the directory as a pathlib.PosixPath.
//   version              FileSystemWriter's CURRENT_DCP_VERSION ("1.0.0" in torch 2.11);
//                        absent or None in files of releases that had none.
// A dataclass pickles its __dict__ (or what its __getstate__ returns), which may lack a
// field: MetadataIndex.__init__ sets no offset for a non-tensor, _StorageInfo drops a None
// transform_descriptors, and a file of an older release lacks the fields added since. A
// missing field reads as its class default.
//
// What parse_metadata refuses, each with the fqn it concerns: a class or field of another
// kind than the above; a dtype this file does not know; a layout other than torch.strided or
// a memory format other than contiguous (the only ones DCP writes); a chunk whose dimensions or
// box do not fit the tensor's size; a chunk with no storage entry, a storage entry that
// matches no chunk or that names a chunk twice, a non-tensor without exactly one; a key
// of state_dict_metadata or planner_data that appears twice, and a planner_data key with no
// entry. It does not check that a tensor's chunks cover it without overlap: that is for the
// loader, which reads them. Fields of newer DCP versions that this model lacks are ignored.
//
// Errors are std::runtime_error whose message starts "fsdp: dcp: '<what>': " (what: the
// file the bytes came from); serialize_metadata throws std::invalid_argument starting
// "fsdp: dcp: " for metadata parse_metadata would refuse.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::state::dcp {

/// ChunkStorageMetadata: one saved box of a tensor, in global coordinates.
struct Chunk {
  std::vector<int64_t> offsets, sizes;
};

/// _StorageInfo: where a chunk's bytes lie, relative to the checkpoint directory.
struct StorageInfo {
  std::string relative_path;
  int64_t offset = 0, length = 0;
  /// Whether the bytes went through a stream transform (compression, ...): that
  /// transform_descriptors is present and non-empty. The torch side refuses to read those.
  bool transformed = false;
  /// The transforms' descriptors as Python wrote them; serialize_metadata writes them back
  /// (and refuses transformed without them, or them without transformed).
  std::vector<std::string> transform_descriptors;
};

/// One element of a planner_data path: a str key of a dict, or an int index into a list.
struct PathPart {
  bool is_index = false;
  std::string key;
  int64_t index = 0;
};

/// One flattened key of the state dict ([Note: DCP metadata]).
struct Entry {
  std::string fqn;                  // the flattened key, e.g. "model.0.weight", "optim.param_groups.0.lr"
  bool is_tensor = false;           // TensorStorageMetadata (true) or BytesStorageMetadata (false)
  std::vector<int64_t> size;        // tensor: global shape (torch.Size)
  std::string dtype;                // tensor: torch dtype name without "torch.": "float32", "bfloat16"
  bool requires_grad = false, pin_memory = false;  // TensorProperties; layout strided, memory contiguous
  std::vector<Chunk> chunks;        // tensor: the saved boxes
  std::vector<StorageInfo> storage; // tensor: one per chunk, same order; non-tensor: exactly one
  std::vector<PathPart> path;       // planner_data[fqn] (empty when absent)
};

struct Metadata {
  std::vector<Entry> entries;       // in state_dict_metadata order
  std::string version;              // Metadata.version ("1.0.0"); empty when absent or None
  std::string save_id;              // StorageMeta.save_id ("" when no storage_meta)
  std::string checkpoint_id;        // StorageMeta.checkpoint_id as a path string ("" when None)
  std::string load_id;              // StorageMeta.load_id ("" when None; set by a load, not a save)
  std::vector<std::string> modules; // StorageMeta.modules
  /// planner_data's order, as indices into `entries`: parse_metadata fills it. It may differ
  /// from the entries' order (a replicated value that a later rank saved comes later in
  /// state_dict_metadata than in the flattened state dict). Empty: the entries' order. When
  /// set, it lists each entry that has a path exactly once.
  std::vector<size_t> planner_order;

  /// The entry named `fqn`; nullptr when none. A linear search: build a map for many.
  const Entry* find(const std::string& fqn) const;
};

/// The metadata the pickle `bytes` holds ([Note: DCP metadata]); `what` names the file in
/// errors. Throws std::runtime_error starting "fsdp: dcp: '<what>': ".
Metadata parse_metadata(std::string_view bytes, const std::string& what);

/// `m` as the pickle Python's DCP writer writes (protocol 4, the same classes, opcodes and
/// field order): Python's pickle.loads of it gives a Metadata equal to the one Python wrote.
/// storage_data is written in FileSystemWriter's order ([Note: DCP metadata]), planner_data
/// in planner_order, and objects are shared as in a save through torch.distributed
/// ([Note: DCP object sharing] in dcp_metadata_write.cpp), so that a file Python wrote that
/// way and parse_metadata read is written again byte for byte. The StorageMeta is written
/// when any of its fields is set, else None; checkpoint_id as a pathlib.PosixPath.
/// Throws std::invalid_argument for metadata that metadata_problem finds wrong.
std::string serialize_metadata(const Metadata& m);

/// What makes `m` metadata that parse_metadata would refuse ("" when nothing): a repeated
/// fqn, an unknown dtype, a chunk outside its tensor, a storage list of the wrong length, a
/// negative index in a path, a planner_order that is not a permutation of the entries with
/// a path. The message names the entry.
std::string metadata_problem(const Metadata& m);

/// Whether `name` is a torch dtype this model reads and writes ("float32", "bfloat16", ...).
bool is_known_dtype(std::string_view name);

// Equal field by field (what a test compares after a round trip).
bool operator==(const Chunk& a, const Chunk& b);
bool operator==(const StorageInfo& a, const StorageInfo& b);
bool operator==(const PathPart& a, const PathPart& b);
bool operator==(const Entry& a, const Entry& b);
bool operator==(const Metadata& a, const Metadata& b);

}  // namespace fsdp::state::dcp
