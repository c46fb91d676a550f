#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dcp_metadata.h"
#include "pickle_codec.h"

// Writing the typed model as DCP's `.metadata` ([Note: DCP metadata] in dcp_metadata.h):
// the tree of values Python's pickler would walk, built with the classes, field order and
// construction DCP's dataclasses pickle with, and written by the pickle codec. What the
// tree shares decides the bytes:
//
// [Note: DCP object sharing]
// Python's pickler writes an object it has written before as a memo reference, and "the
// same object" is Python's identity, not equality: two equal strings are written twice
// unless they are one object. Which are one object follows from how a save through
// torch.distributed builds the metadata, and this writer makes the same ones the same:
//  - one object per class, per dtype, for torch.strided and for each memory-format member;
//    the metadata classes share their module's name, as do the dtypes theirs ('torch'), but
//    torch.Size has a 'torch' of its own (the dtypes' is sys.modules' key, torch.Size's its
//    __module__);
//  - attribute names are interned: one per name in the file (MetadataIndex's 'offset' is
//    _StorageInfo's);
//  - a string of one ASCII character, or none, is one of CPython's singletons, wherever
//    it appears;
//  - the coordinator builds the metadata from the ranks' plans, each unpickled from a
//    gather: a state_dict_metadata key is the fqn in the plan of the first rank that saved
//    the entry; planner_data is dict(ChainMap(*mappings)), so its keys are the last rank's
//    fqns (the same object as the state_dict_metadata key exactly when the last rank saved
//    the entry first) and its paths are rank 0's;
//  - in rank 0's paths, a key is one object wherever its dict appears (the same prefix); a
//    name-like key ('exp_avg', 'weight': only letters, digits and '_') is a literal or an
//    attribute name, interned, so one object wherever it appears; a one-part path's key is
//    the fqn itself (str.join of a single str returns that str);
//  - storage_data comes from each rank's write results, gathered again: a MetadataIndex's
//    fqn is one object per rank and entry, a relative path one per file.
// Ranks are read from FileSystemWriter's file names (__<rank>_<n>.distcp). A file that
// another writer named, or that a save without a process group wrote (nothing is gathered
// there, so a MetadataIndex's fqn is the entry's key), holds the same values with other
// memo references, and Python reads it as the same Metadata.

// The state layer is compiled as a unity build: this file's helpers live in a named
// namespace of their own, not an anonymous one that another file's could collide with.
namespace fsdp::state::dcp::write_detail {

namespace pk = fsdp::state::pickle;
using pk::Construction;
using pk::Value;

constexpr const char* kMetadataModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kFilesystemModule = "torch.distributed.checkpoint.filesystem";
constexpr int kProtocol = 4;  // pickle.dump's default from Python 3.8 to 3.13
constexpr int64_t kNoRank = -1;

// FileSystemWriter's `__<rank>_<n>.distcp`, or found = false.
struct FileName {
  bool found = false;
  int64_t rank = 0, number = 0;
};

bool read_decimal(const std::string& s, size_t& at, int64_t& out) {
  const size_t begin = at;
  out = 0;
  while (at < s.size() && s[at] >= '0' && s[at] <= '9' && at - begin < 18) out = out * 10 + (s[at++] - '0');
  return at > begin;
}

FileName file_name(const std::string& path) {
  FileName f;
  size_t at = 2;
  if (path.rfind("__", 0) != 0 || !read_decimal(path, at, f.rank) || at >= path.size() || path[at++] != '_' ||
      !read_decimal(path, at, f.number) || path.substr(at) != ".distcp")
    return FileName{};
  f.found = true;
  return f;
}

bool name_like(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

// PurePosixPath's parts: the root ('/', or '//' for exactly two leading slashes), then
// the names between slashes, without empty ones and '.'.
std::vector<std::string> posix_parts(const std::string& path) {
  std::vector<std::string> parts;
  size_t slashes = 0;
  while (slashes < path.size() && path[slashes] == '/') ++slashes;
  if (slashes > 0) parts.push_back(slashes == 2 ? "//" : "/");
  for (size_t at = slashes; at < path.size();) {
    const size_t end = std::min(path.find('/', at), path.size());
    const std::string name = path.substr(at, end - at);
    if (!name.empty() && name != ".") parts.push_back(name);
    at = end + 1;
  }
  return parts;
}

// A chunk's storage (chunk 0 of a non-tensor: its one value).
struct StorageRef {
  size_t entry, chunk;
};

class MetadataWriter {
 public:
  explicit MetadataWriter(const Metadata& m);
  std::string write();

 private:
  // Python's shared objects ([Note: DCP object sharing]).
  Value fresh(const std::string& s);
  Value attribute(const char* name);
  Value module(const std::string& key, const char* name);
  Value cls(const char* module_name, const char* name);
  Value dtype(const std::string& name);
  Value rank0_part(const std::string& prefix, const std::string& key);
  Value shared(std::map<std::string, Value>& table, const std::string& key, const std::string& text);
  // The file's parts, as DCP's dataclasses pickle.
  Value instance(const char* module_name, const char* name, const std::vector<std::pair<const char*, Value>>& fields);
  Value torch_size(const std::vector<int64_t>& dims);
  Value properties(const Entry& e);
  Value entry_metadata(const Entry& e);
  Value state_dict_metadata();
  Value path_of(const Entry& e);
  Value planner_data();
  std::vector<StorageRef> storage_order() const;
  Value storage_data();
  Value storage_info(const StorageInfo& s);
  Value storage_meta();

  const Metadata& m_;
  std::vector<int64_t> first_rank_;  // per entry: the lowest rank that saved it (kNoRank: unknown)
  int64_t last_rank_ = kNoRank;
  std::vector<Value> keys_;  // per entry: its state_dict_metadata key
  std::map<std::string, Value> attributes_, modules_, classes_, dtypes_, singletons_, rank0_names_, rank0_keys_,
      index_fqns_, paths_;
  Value strided_, contiguous_;
};

MetadataWriter::MetadataWriter(const Metadata& m) : m_(m), first_rank_(m.entries.size(), kNoRank) {
  for (size_t i = 0; i < m.entries.size(); ++i)
    for (const StorageInfo& s : m.entries[i].storage) {
      const FileName f = file_name(s.relative_path);
      if (!f.found) continue;
      if (first_rank_[i] == kNoRank || f.rank < first_rank_[i]) first_rank_[i] = f.rank;
      last_rank_ = std::max(last_rank_, f.rank);
    }
}

std::string MetadataWriter::write() {
  // Field order of Metadata's __dict__ (its dataclass fields).
  const Value sdm = state_dict_metadata();
  const Value md = instance(kMetadataModule, "Metadata",
                            {{"state_dict_metadata", sdm},
                             {"planner_data", planner_data()},
                             {"storage_data", storage_data()},
                             {"storage_meta", storage_meta()},
                             {"version", m_.version.empty() ? Value() : fresh(m_.version)}});
  return pk::write(md, kProtocol);
}

Value MetadataWriter::shared(std::map<std::string, Value>& table, const std::string& key, const std::string& text) {
  auto it = table.find(key);
  if (it == table.end()) it = table.emplace(key, fresh(text)).first;
  return it->second;
}

Value MetadataWriter::fresh(const std::string& s) {
  const bool singleton = s.empty() || (s.size() == 1 && static_cast<unsigned char>(s[0]) < 0x80);
  if (!singleton) return Value::string(s);
  auto it = singletons_.find(s);
  if (it == singletons_.end()) it = singletons_.emplace(s, Value::string(s)).first;
  return it->second;
}

Value MetadataWriter::attribute(const char* name) { return shared(attributes_, name, name); }

Value MetadataWriter::module(const std::string& key, const char* name) { return shared(modules_, key, name); }

Value MetadataWriter::cls(const char* module_name, const char* name) {
  const std::string key = std::string(module_name) + "." + name;
  auto it = classes_.find(key);
  if (it == classes_.end())
    it = classes_.emplace(key, Value::global(module(module_name, module_name), Value::string(name))).first;
  return it->second;
}

Value MetadataWriter::dtype(const std::string& name) {
  auto it = dtypes_.find(name);
  if (it == dtypes_.end())
    it = dtypes_.emplace(name, Value::global(module("torch dtypes", "torch"), Value::string(name))).first;
  return it->second;
}

Value MetadataWriter::rank0_part(const std::string& prefix, const std::string& key) {
  if (name_like(key)) return shared(rank0_names_, key, key);
  return shared(rank0_keys_, prefix + std::to_string(key.size()) + ":" + key, key);
}

Value MetadataWriter::instance(const char* module_name, const char* name,
                               const std::vector<std::pair<const char*, Value>>& fields) {
  Value v = Value::object(Construction::NewObj, cls(module_name, name), Value::tuple({}));
  std::vector<Value::Entry> state;
  for (const auto& [field, value] : fields) state.emplace_back(attribute(field), value);
  v.set_state(Value::dict(std::move(state)));
  return v;
}

Value MetadataWriter::torch_size(const std::vector<int64_t>& dims) {
  std::vector<Value> items;
  for (int64_t d : dims) items.push_back(Value::integer(d));
  return Value::object(Construction::Reduce, cls("torch", "Size"), Value::tuple({Value::tuple(std::move(items))}));
}

// TensorProperties.__getstate__: (dtype, layout, requires_grad, memory-format code, pin_memory).
Value MetadataWriter::properties(const Entry& e) {
  if (strided_.is_none()) {
    strided_ = Value::object(Construction::Reduce, cls("torch.serialization", "_get_layout"),
                             Value::tuple({fresh("torch.strided")}));
    contiguous_ = Value::object(Construction::Reduce, cls(kMetadataModule, "_MEM_FORMAT_ENCODING"),
                                Value::tuple({Value::integer(0)}));
  }
  Value v = Value::object(Construction::NewObj, cls(kMetadataModule, "TensorProperties"), Value::tuple({}));
  v.set_state(Value::tuple({dtype(e.dtype), strided_, Value::boolean(e.requires_grad), contiguous_,
                            Value::boolean(e.pin_memory)}));
  return v;
}

Value MetadataWriter::entry_metadata(const Entry& e) {
  if (!e.is_tensor)  // no fields: pickled without state
    return Value::object(Construction::NewObj, cls(kMetadataModule, "BytesStorageMetadata"), Value::tuple({}));
  const Value props = properties(e);
  const Value size = torch_size(e.size);
  std::vector<Value> chunks;
  for (const Chunk& c : e.chunks)
    chunks.push_back(instance(kMetadataModule, "ChunkStorageMetadata",
                              {{"offsets", torch_size(c.offsets)}, {"sizes", torch_size(c.sizes)}}));
  return instance(kMetadataModule, "TensorStorageMetadata",
                  {{"properties", props}, {"size", size}, {"chunks", Value::list(std::move(chunks))}});
}

Value MetadataWriter::state_dict_metadata() {
  std::vector<Value::Entry> items;
  for (size_t i = 0; i < m_.entries.size(); ++i) {
    const Entry& e = m_.entries[i];
    const bool rank0_part_is_key =
        first_rank_[i] == 0 && e.path.size() == 1 && !e.path[0].is_index && e.path[0].key == e.fqn;
    keys_.push_back(rank0_part_is_key ? rank0_part("", e.fqn) : fresh(e.fqn));
    items.emplace_back(keys_.back(), entry_metadata(e));
  }
  return Value::dict(std::move(items));
}

Value MetadataWriter::path_of(const Entry& e) {
  std::vector<Value> parts;
  std::string prefix;
  for (const PathPart& p : e.path) {
    if (p.is_index) {
      parts.push_back(Value::integer(p.index));
      prefix += "i" + std::to_string(p.index) + ";";
    } else {
      parts.push_back(rank0_part(prefix, p.key));
      prefix += "s" + std::to_string(p.key.size()) + ":" + p.key;
    }
  }
  return Value::tuple(std::move(parts));
}

Value MetadataWriter::planner_data() {
  std::vector<size_t> order = m_.planner_order;
  if (order.empty())
    for (size_t i = 0; i < m_.entries.size(); ++i)
      if (!m_.entries[i].path.empty()) order.push_back(i);
  if (order.empty()) return Value();
  std::vector<Value::Entry> items;
  for (size_t i : order) {
    const bool last_rank_key = first_rank_[i] != kNoRank && first_rank_[i] == last_rank_;
    const Value key = last_rank_key ? keys_[i] : fresh(m_.entries[i].fqn);
    items.emplace_back(key, path_of(m_.entries[i]));
  }
  return Value::dict(std::move(items));
}

// FileSystemWriter's order: by rank, then file, then offset; other names after, by name.
std::vector<StorageRef> MetadataWriter::storage_order() const {
  using Key = std::tuple<bool, int64_t, int64_t, std::string, int64_t>;
  std::vector<std::pair<Key, StorageRef>> keyed;
  for (size_t i = 0; i < m_.entries.size(); ++i)
    for (size_t c = 0; c < m_.entries[i].storage.size(); ++c) {
      const StorageInfo& s = m_.entries[i].storage[c];
      const FileName f = file_name(s.relative_path);
      keyed.emplace_back(Key{!f.found, f.rank, f.number, f.found ? std::string() : s.relative_path, s.offset},
                         StorageRef{i, c});
    }
  std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<StorageRef> refs;
  for (const auto& k : keyed) refs.push_back(k.second);
  return refs;
}

Value MetadataWriter::storage_data() {
  std::vector<Value::Entry> items;
  for (const StorageRef& r : storage_order()) {
    const Entry& e = m_.entries[r.entry];
    const StorageInfo& s = e.storage[r.chunk];
    // One fqn object per rank's results (per file where the rank is unknown).
    const FileName f = file_name(s.relative_path);
    const std::string results = f.found ? "@" + std::to_string(f.rank) : "/" + s.relative_path;
    const Value fqn = shared(index_fqns_, std::to_string(r.entry) + results, e.fqn);
    // MetadataIndex.__init__ sets fqn, then index, then offset only when there is one.
    Value index = e.is_tensor ? instance(kMetadataModule, "MetadataIndex",
                                         {{"fqn", fqn},
                                          {"index", Value::integer(static_cast<int64_t>(r.chunk))},
                                          {"offset", torch_size(e.chunks[r.chunk].offsets)}})
                              : instance(kMetadataModule, "MetadataIndex", {{"fqn", fqn}, {"index", Value()}});
    items.emplace_back(std::move(index), storage_info(s));
  }
  return Value::dict(std::move(items));
}

// _StorageInfo.__getstate__ leaves out the fields that are None.
Value MetadataWriter::storage_info(const StorageInfo& s) {
  std::vector<std::pair<const char*, Value>> fields = {
      {"relative_path", shared(paths_, s.relative_path, s.relative_path)},
      {"offset", Value::integer(s.offset)},
      {"length", Value::integer(s.length)}};
  if (!s.transform_descriptors.empty()) {
    std::vector<Value> descriptors;
    for (const std::string& d : s.transform_descriptors) descriptors.push_back(fresh(d));
    fields.emplace_back("transform_descriptors", Value::list(std::move(descriptors)));
  }
  return instance(kFilesystemModule, "_StorageInfo", fields);
}

// pathlib.PurePath.__reduce__: (its class, its parts).
Value MetadataWriter::storage_meta() {
  if (m_.checkpoint_id.empty() && m_.save_id.empty() && m_.load_id.empty() && m_.modules.empty()) return Value();
  Value checkpoint_id;
  if (!m_.checkpoint_id.empty()) {
    std::vector<Value> parts;
    for (const std::string& p : posix_parts(m_.checkpoint_id)) parts.push_back(fresh(p));
    checkpoint_id = Value::object(Construction::Reduce, cls("pathlib", "PosixPath"), Value::tuple(std::move(parts)));
  }
  std::vector<Value> modules;
  for (const std::string& name : m_.modules) modules.push_back(fresh(name));
  const auto optional_text = [this](const std::string& s) { return s.empty() ? Value() : fresh(s); };
  return instance(kMetadataModule, "StorageMeta",
                  {{"checkpoint_id", checkpoint_id},
                   {"save_id", optional_text(m_.save_id)},
                   {"load_id", optional_text(m_.load_id)},
                   {"modules", Value::list(std::move(modules))}});
}

}  // namespace fsdp::state::dcp::write_detail

namespace fsdp::state::dcp {

std::string serialize_metadata(const Metadata& m) {
  if (std::string problem = metadata_problem(m); !problem.empty())
    throw std::invalid_argument("fsdp: dcp: cannot serialize the metadata: " + problem);
  return write_detail::MetadataWriter(m).write();
}

}  // namespace fsdp::state::dcp
