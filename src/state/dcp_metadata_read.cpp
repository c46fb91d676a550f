#include <stdexcept>
#include <unordered_map>

#include "dcp_metadata.h"
#include "pickle_codec.h"

// Reading a DCP `.metadata` into the typed model ([Note: DCP metadata] in dcp_metadata.h).
// The pickle is read into a tree of values first (pickle_codec.h); the tree is then read
// in the order its parts depend on one another: the entries (state_dict_metadata), then
// the storage each chunk names (storage_data, matched to the entries by fqn and offsets),
// then the paths (planner_data), then the StorageMeta and the version. Every value is
// checked for its kind before it is used, so that a damaged file ends in a message that
// says where, never in an accessor's complaint.

// The state layer is compiled as a unity build: this file's helpers live in a named
// namespace of their own, not an anonymous one that another file's could collide with.
namespace fsdp::state::dcp::read_detail {

namespace pk = fsdp::state::pickle;
using pk::Value;
using Kind = Value::Kind;

constexpr const char* kMetadataModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kFilesystemModule = "torch.distributed.checkpoint.filesystem";

class MetadataReader {
 public:
  explicit MetadataReader(const std::string& what) : what_(what) {}
  Metadata read(std::string_view bytes);

 private:
  [[noreturn]] void fail(const std::string& where, const std::string& message) const;
  // Values of one kind, or the message that says what `where` holds instead.
  void expect_instance(const Value& v, const char* module, const char* name, const std::string& where) const;
  const Value& attributes(const Value& v, const std::string& where) const;
  const Value* optional(const Value& attrs, const char* name) const;  // nullptr: absent or None
  const Value& required(const Value& attrs, const char* name, const std::string& where) const;
  const std::string& text(const Value& v, const std::string& where) const;
  int64_t integer(const Value& v, const std::string& where) const;
  bool flag(const Value& v, const std::string& where) const;
  std::vector<int64_t> torch_size(const Value& v, const std::string& where) const;
  std::vector<std::string> texts(const Value& v, const std::string& where) const;
  // The phases.
  void read_entries(const Value& state_dict_metadata);
  Entry read_tensor(const std::string& fqn, const Value& v, const std::string& where) const;
  void read_properties(const Value& v, Entry& e, const std::string& where) const;
  void read_storage(const Value& storage_data);
  void attach_storage(const Value& index, const Value& info, const std::string& where);
  StorageInfo read_storage_info(const Value& v, const std::string& where) const;
  void check_storage_complete() const;
  void read_planner_data(const Value& planner_data);
  void read_storage_meta(const Value& storage_meta);
  std::string read_checkpoint_id(const Value& v, const std::string& where) const;

  const std::string& what_;
  Metadata m_;
  std::unordered_map<std::string, size_t> by_fqn_;  // index into m_.entries
  std::vector<std::vector<char>> stored_;           // per entry: which chunks (or the one value) have storage
};

void MetadataReader::fail(const std::string& where, const std::string& message) const {
  throw std::runtime_error("fsdp: dcp: '" + what_ + "': " + (where.empty() ? "" : where + ": ") + message);
}

void MetadataReader::expect_instance(const Value& v, const char* module, const char* name,
                                     const std::string& where) const {
  if (!v.is_instance_of(module, name))
    fail(where, "is " + pk::describe(v) + ", not a " + module + "." + name);
}

// A dataclass's fields: BUILD's Dict of attributes.
const Value& MetadataReader::attributes(const Value& v, const std::string& where) const {
  if (!v.has_state()) fail(where, pk::describe(v) + " has no attributes");
  if (v.state().kind() != Kind::Dict) fail(where, "has state " + pk::describe(v.state()) + ", not a Dict of fields");
  return v.state();
}

const Value* MetadataReader::optional(const Value& attrs, const char* name) const {
  const Value* v = attrs.find(name);
  return v && !v->is_none() ? v : nullptr;
}

const Value& MetadataReader::required(const Value& attrs, const char* name, const std::string& where) const {
  const Value* v = optional(attrs, name);
  if (!v) fail(where, std::string("has no '") + name + "'");
  return *v;
}

const std::string& MetadataReader::text(const Value& v, const std::string& where) const {
  if (v.kind() != Kind::String) fail(where, "is " + pk::describe(v) + ", not a str");
  return v.as_string();
}

int64_t MetadataReader::integer(const Value& v, const std::string& where) const {
  if (v.kind() != Kind::Int) fail(where, "is " + pk::describe(v) + ", not an int");
  return v.as_int();
}

bool MetadataReader::flag(const Value& v, const std::string& where) const {
  if (v.kind() != Kind::Bool) fail(where, "is " + pk::describe(v) + ", not a bool");
  return v.as_bool();
}

// torch.Size(dims): REDUCE of torch.Size with one argument, the tuple of dims.
std::vector<int64_t> MetadataReader::torch_size(const Value& v, const std::string& where) const {
  expect_instance(v, "torch", "Size", where);
  const std::vector<Value>& args = v.args().items();
  if (v.construction() != pk::Construction::Reduce || args.size() != 1 ||
      (args[0].kind() != Kind::Tuple && args[0].kind() != Kind::List))
    fail(where, "is a torch.Size not made as torch.Size(<tuple of ints>)");
  std::vector<int64_t> dims;
  for (const Value& d : args[0].items())
    dims.push_back(integer(d, where + " dimension " + std::to_string(dims.size())));
  return dims;
}

std::vector<std::string> MetadataReader::texts(const Value& v, const std::string& where) const {
  if (v.kind() != Kind::List && v.kind() != Kind::Tuple) fail(where, "is " + pk::describe(v) + ", not a list of str");
  std::vector<std::string> out;
  for (const Value& s : v.items()) out.push_back(text(s, where + "[" + std::to_string(out.size()) + "]"));
  return out;
}

Metadata MetadataReader::read(std::string_view bytes) {
  Value root;
  try {
    root = pk::read(bytes, what_);
  } catch (const std::runtime_error& e) {
    // The codec's message already names the file; keep what follows its prefix.
    const std::string prefix = "fsdp: pickle: '" + what_ + "': ";
    std::string message = e.what();
    if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
    fail("", "reading the pickle: " + message);
  }
  expect_instance(root, kMetadataModule, "Metadata", "the file's value");
  const Value& attrs = attributes(root, "Metadata");
  read_entries(required(attrs, "state_dict_metadata", "Metadata"));
  if (const Value* storage = optional(attrs, "storage_data")) read_storage(*storage);
  check_storage_complete();
  if (const Value* planner = optional(attrs, "planner_data")) read_planner_data(*planner);
  if (const Value* meta = optional(attrs, "storage_meta")) read_storage_meta(*meta);
  if (const Value* version = optional(attrs, "version")) m_.version = text(*version, "Metadata.version");
  if (std::string problem = metadata_problem(m_); !problem.empty()) fail("", problem);
  return std::move(m_);
}

void MetadataReader::read_entries(const Value& state_dict_metadata) {
  if (state_dict_metadata.kind() != Kind::Dict)
    fail("state_dict_metadata", "is " + pk::describe(state_dict_metadata) + ", not a dict");
  for (const Value::Entry& kv : state_dict_metadata.entries()) {
    const std::string& fqn = text(kv.first, "a key of state_dict_metadata");
    const std::string where = "state_dict_metadata['" + fqn + "']";
    if (!by_fqn_.emplace(fqn, m_.entries.size()).second) fail(where, "the key appears twice");
    if (kv.second.is_instance_of(kMetadataModule, "TensorStorageMetadata")) {
      m_.entries.push_back(read_tensor(fqn, kv.second, where));
    } else if (kv.second.is_instance_of(kMetadataModule, "BytesStorageMetadata")) {
      Entry e;
      e.fqn = fqn;
      m_.entries.push_back(std::move(e));
    } else {
      fail(where, "is " + pk::describe(kv.second) + ", not a TensorStorageMetadata or BytesStorageMetadata");
    }
    stored_.emplace_back(m_.entries.back().is_tensor ? m_.entries.back().chunks.size() : 1, 0);
  }
}

Entry MetadataReader::read_tensor(const std::string& fqn, const Value& v, const std::string& where) const {
  Entry e;
  e.fqn = fqn;
  e.is_tensor = true;
  const Value& attrs = attributes(v, where);
  read_properties(required(attrs, "properties", where), e, where + ".properties");
  e.size = torch_size(required(attrs, "size", where), where + ".size");
  const Value& chunks = required(attrs, "chunks", where);
  if (chunks.kind() != Kind::List) fail(where + ".chunks", "is " + pk::describe(chunks) + ", not a list");
  for (const Value& c : chunks.items()) {
    const std::string at = where + ".chunks[" + std::to_string(e.chunks.size()) + "]";
    expect_instance(c, kMetadataModule, "ChunkStorageMetadata", at);
    const Value& chunk = attributes(c, at);
    e.chunks.push_back(Chunk{torch_size(required(chunk, "offsets", at), at + ".offsets"),
                             torch_size(required(chunk, "sizes", at), at + ".sizes")});
  }
  e.storage.resize(e.chunks.size());
  return e;
}

// TensorProperties pickles its __getstate__: (dtype, layout, requires_grad, memory-format
// code, pin_memory), the layout as torch.serialization._get_layout('torch.strided') and the
// memory format as _MEM_FORMAT_ENCODING(code), an Enum member, since neither pickles itself.
void MetadataReader::read_properties(const Value& v, Entry& e, const std::string& where) const {
  expect_instance(v, kMetadataModule, "TensorProperties", where);
  if (!v.has_state() || v.state().kind() != Kind::Tuple || v.state().items().size() != 5)
    fail(where, "has no state of five fields (dtype, layout, requires_grad, memory_format, pin_memory)");
  const std::vector<Value>& p = v.state().items();
  if (p[0].kind() != Kind::Global || p[0].module() != "torch")
    fail(where + ".dtype", "is " + pk::describe(p[0]) + ", not a torch dtype");
  e.dtype = p[0].name();
  if (!is_known_dtype(e.dtype)) fail(where + ".dtype", "torch." + e.dtype + " is not a dtype this reader knows");
  const Value& layout = p[1];
  if (!layout.is_instance_of("torch.serialization", "_get_layout") || layout.args().items().size() != 1)
    fail(where + ".layout", "is " + pk::describe(layout) + ", not torch.serialization._get_layout(<name>)");
  const std::string& layout_name = text(layout.args().items()[0], where + ".layout");
  if (layout_name != "torch.strided")
    fail(where + ".layout", "is " + layout_name + "; only torch.strided tensors are read");
  e.requires_grad = flag(p[2], where + ".requires_grad");
  const Value& format = p[3];
  if (!format.is_instance_of(kMetadataModule, "_MEM_FORMAT_ENCODING") || format.args().items().size() != 1)
    fail(where + ".memory_format", "is " + pk::describe(format) + ", not a _MEM_FORMAT_ENCODING member");
  const int64_t code = integer(format.args().items()[0], where + ".memory_format");
  if (code != 0)
    fail(where + ".memory_format", "is _MEM_FORMAT_ENCODING(" + std::to_string(code) +
                                       "); only torch.contiguous_format (0) is read");
  e.pin_memory = flag(p[4], where + ".pin_memory");
}

void MetadataReader::read_storage(const Value& storage_data) {
  if (storage_data.kind() != Kind::Dict)
    fail("storage_data", "is " + pk::describe(storage_data) + ", not a dict");
  size_t n = 0;
  for (const Value::Entry& kv : storage_data.entries()) {
    const std::string where = "storage_data entry " + std::to_string(n++);
    attach_storage(kv.first, kv.second, where);
  }
}

// A MetadataIndex names a tensor's chunk by (fqn, offsets), or a non-tensor by fqn alone.
// The index hint is probed first, as DCP's own lookup does; a wrong hint costs a search.
void MetadataReader::attach_storage(const Value& index, const Value& info, const std::string& where) {
  expect_instance(index, kMetadataModule, "MetadataIndex", where);
  const Value& key = attributes(index, where);
  const std::string& fqn = text(required(key, "fqn", where), where + " fqn");
  const std::string at = where + " ('" + fqn + "')";
  const auto it = by_fqn_.find(fqn);
  if (it == by_fqn_.end()) fail(at, "names no entry of state_dict_metadata");
  Entry& e = m_.entries[it->second];
  std::vector<char>& stored = stored_[it->second];
  const Value* offset = optional(key, "offset");
  const Value* hint = optional(key, "index");
  int64_t probe = hint ? integer(*hint, at + " index") : -1;
  size_t slot = 0;
  if (e.is_tensor) {
    if (!offset) fail(at, "has no offset, but '" + fqn + "' is a tensor");
    const std::vector<int64_t> offsets = torch_size(*offset, at + " offset");
    if (probe < 0 || probe >= static_cast<int64_t>(e.chunks.size()) || e.chunks[probe].offsets != offsets) {
      probe = -1;
      for (size_t c = 0; c < e.chunks.size() && probe < 0; ++c)
        if (e.chunks[c].offsets == offsets) probe = static_cast<int64_t>(c);
    }
    if (probe < 0) fail(at, "matches none of the tensor's chunks by offset");
    slot = static_cast<size_t>(probe);
  } else if (offset) {
    fail(at, "has an offset, but '" + fqn + "' is not a tensor");
  }
  if (stored[slot])
    fail(at, "names a " + std::string(e.is_tensor ? "chunk" : "value") + " that an earlier entry named");
  stored[slot] = 1;
  if (e.is_tensor) {
    e.storage[slot] = read_storage_info(info, at);
  } else {
    e.storage.push_back(read_storage_info(info, at));
  }
}

StorageInfo MetadataReader::read_storage_info(const Value& v, const std::string& where) const {
  expect_instance(v, kFilesystemModule, "_StorageInfo", where);
  const Value& attrs = attributes(v, where);
  StorageInfo info;
  info.relative_path = text(required(attrs, "relative_path", where), where + " relative_path");
  info.offset = integer(required(attrs, "offset", where), where + " offset");
  info.length = integer(required(attrs, "length", where), where + " length");
  if (const Value* t = optional(attrs, "transform_descriptors"))
    info.transform_descriptors = texts(*t, where + " transform_descriptors");
  info.transformed = !info.transform_descriptors.empty();
  return info;
}

void MetadataReader::check_storage_complete() const {
  for (size_t i = 0; i < m_.entries.size(); ++i) {
    const Entry& e = m_.entries[i];
    for (size_t c = 0; c < stored_[i].size(); ++c) {
      if (stored_[i][c]) continue;
      if (!e.is_tensor) fail("'" + e.fqn + "'", "has no storage_data entry");
      fail("'" + e.fqn + "'", "chunk " + std::to_string(c) + " has no storage_data entry");
    }
  }
}

void MetadataReader::read_planner_data(const Value& planner_data) {
  if (planner_data.kind() != Kind::Dict)
    fail("planner_data", "is " + pk::describe(planner_data) + ", not a dict");
  for (const Value::Entry& kv : planner_data.entries()) {
    const std::string& fqn = text(kv.first, "a key of planner_data");
    const std::string where = "planner_data['" + fqn + "']";
    const auto it = by_fqn_.find(fqn);
    if (it == by_fqn_.end()) fail(where, "names no entry of state_dict_metadata");
    Entry& e = m_.entries[it->second];
    if (!e.path.empty()) fail(where, "the key appears twice");
    if (kv.second.kind() != Kind::Tuple && kv.second.kind() != Kind::List)
      fail(where, "is " + pk::describe(kv.second) + ", not a tuple of str and int");
    if (kv.second.items().empty()) fail(where, "is an empty path");
    for (const Value& part : kv.second.items()) {
      if (part.kind() == Kind::String) {
        e.path.push_back(PathPart{false, part.as_string(), 0});
      } else if (part.kind() == Kind::Int) {
        e.path.push_back(PathPart{true, "", part.as_int()});
      } else {
        fail(where, "holds " + pk::describe(part) + ", not a str key or an int index");
      }
    }
    m_.planner_order.push_back(it->second);
  }
  // Left empty when it says nothing more than the entries' own order.
  std::vector<size_t> natural;
  for (size_t i = 0; i < m_.entries.size(); ++i)
    if (!m_.entries[i].path.empty()) natural.push_back(i);
  if (m_.planner_order == natural) m_.planner_order.clear();
}

void MetadataReader::read_storage_meta(const Value& storage_meta) {
  expect_instance(storage_meta, kMetadataModule, "StorageMeta", "storage_meta");
  const Value& attrs = attributes(storage_meta, "storage_meta");
  if (const Value* id = optional(attrs, "checkpoint_id"))
    m_.checkpoint_id = read_checkpoint_id(*id, "storage_meta.checkpoint_id");
  if (const Value* id = optional(attrs, "save_id")) m_.save_id = text(*id, "storage_meta.save_id");
  if (const Value* id = optional(attrs, "load_id")) m_.load_id = text(*id, "storage_meta.load_id");
  if (const Value* modules = optional(attrs, "modules")) m_.modules = texts(*modules, "storage_meta.modules");
}

// A str, or a pathlib path: REDUCE of its class with its parts ('/', 'tmp', 'ck'), which
// are joined as the class's constructor joins them. Python 3.13 moved the classes to
// pathlib._local, hence any module under pathlib.
std::string MetadataReader::read_checkpoint_id(const Value& v, const std::string& where) const {
  if (v.kind() == Kind::String) return v.as_string();
  const bool path = v.kind() == Kind::Object && v.cls().kind() == Kind::Global &&
                    v.cls().module().rfind("pathlib", 0) == 0 &&
                    (v.cls().name() == "PosixPath" || v.cls().name() == "PurePosixPath");
  if (!path) fail(where, "is " + pk::describe(v) + ", not a str or a pathlib.PosixPath");
  std::string joined;
  for (const std::string& part : texts(v.args(), where)) {
    if (part.empty()) continue;
    if (part[0] == '/' || joined.empty()) {
      joined = part;
    } else {
      joined += (joined.back() == '/' ? "" : "/") + part;
    }
  }
  return joined.empty() ? "." : joined;
}

}  // namespace fsdp::state::dcp::read_detail

namespace fsdp::state::dcp {

Metadata parse_metadata(std::string_view bytes, const std::string& what) {
  return read_detail::MetadataReader(what).read(bytes);
}

}  // namespace fsdp::state::dcp
