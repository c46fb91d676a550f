#include "dcp_metadata.h"

#include <algorithm>
#include <unordered_set>

// The typed model's own rules ([Note: DCP metadata] in dcp_metadata.h): what makes
// metadata loadable, shared by the reader (dcp_metadata_read.cpp), which refuses a file
// that breaks them, and the writer (dcp_metadata_write.cpp), which refuses to write one.

// The state layer is compiled as a unity build: this file's helpers live in a named
// namespace of their own, not an anonymous one that another file's could collide with.
namespace fsdp::state::dcp::model_detail {

// The dtypes a DCP checkpoint of dense tensors holds, by the names torch pickles them
// under (torch.<name>). Quantized and sub-byte dtypes are left out: DCP cannot save them
// as plain strided tensors, and the torch side would have no ScalarType to load them into.
constexpr std::string_view kDtypes[] = {
    "bool",     "uint8",    "int8",       "int16",         "int32",         "int64",
    "uint16",   "uint32",   "uint64",     "float16",       "bfloat16",      "float32",
    "float64",  "complex32", "complex64", "complex128",    "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
};

std::string ints(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

bool any_negative(const std::vector<int64_t>& v) {
  return std::any_of(v.begin(), v.end(), [](int64_t x) { return x < 0; });
}

std::string chunk_problem(const Chunk& c, size_t i, const std::vector<int64_t>& size) {
  const std::string chunk = "chunk " + std::to_string(i) + " (offsets " + ints(c.offsets) + ", sizes " +
                            ints(c.sizes) + ")";
  if (c.offsets.size() != size.size() || c.sizes.size() != size.size())
    return chunk + " does not have the tensor's " + std::to_string(size.size()) + " dimensions (size " +
           ints(size) + ")";
  if (any_negative(c.offsets) || any_negative(c.sizes)) return chunk + " has a negative offset or size";
  for (size_t d = 0; d < size.size(); ++d)
    if (c.offsets[d] > size[d] || c.sizes[d] > size[d] - c.offsets[d])
      return chunk + " lies outside the tensor's size " + ints(size);
  return "";
}

std::string storage_problem(const StorageInfo& s, const std::string& which) {
  if (s.relative_path.empty()) return which + " has no relative_path";
  if (s.offset < 0 || s.length < 0)
    return which + " has a negative offset or length (" + std::to_string(s.offset) + ", " +
           std::to_string(s.length) + ")";
  if (s.transformed == s.transform_descriptors.empty())
    return which + (s.transformed ? " is transformed but names no transform_descriptors"
                                  : " has transform_descriptors but is not marked transformed");
  return "";
}

std::string tensor_problem(const Entry& e) {
  if (!is_known_dtype(e.dtype)) return "dtype '" + e.dtype + "' is not a torch dtype this reader knows";
  if (any_negative(e.size)) return "size " + ints(e.size) + " has a negative dimension";
  for (size_t i = 0; i < e.chunks.size(); ++i)
    if (std::string p = chunk_problem(e.chunks[i], i, e.size); !p.empty()) return p;
  if (e.storage.size() != e.chunks.size())
    return std::to_string(e.chunks.size()) + " chunk(s) but " + std::to_string(e.storage.size()) +
           " storage entries (one per chunk)";
  for (size_t i = 0; i < e.storage.size(); ++i)
    if (std::string p = storage_problem(e.storage[i], "the storage of chunk " + std::to_string(i)); !p.empty())
      return p;
  return "";
}

std::string bytes_problem(const Entry& e) {
  if (!e.size.empty() || !e.dtype.empty() || !e.chunks.empty())
    return "a non-tensor entry has a size, a dtype or chunks, which only a tensor has";
  if (e.storage.size() != 1)
    return "a non-tensor entry has " + std::to_string(e.storage.size()) + " storage entries, not one";
  return storage_problem(e.storage[0], "its storage");
}

std::string entry_problem(const Entry& e) {
  for (const PathPart& p : e.path)
    if (p.is_index && p.index < 0) return "its path has a negative list index " + std::to_string(p.index);
  return e.is_tensor ? tensor_problem(e) : bytes_problem(e);
}

std::string planner_order_problem(const Metadata& m) {
  if (m.planner_order.empty()) return "";
  std::vector<char> listed(m.entries.size(), 0);
  for (size_t i : m.planner_order) {
    if (i >= m.entries.size())
      return "planner_order names entry " + std::to_string(i) + " of " + std::to_string(m.entries.size());
    if (m.entries[i].path.empty()) return "planner_order names '" + m.entries[i].fqn + "', which has no path";
    if (listed[i]) return "planner_order names '" + m.entries[i].fqn + "' twice";
    listed[i] = 1;
  }
  for (size_t i = 0; i < m.entries.size(); ++i)
    if (!listed[i] && !m.entries[i].path.empty())
      return "planner_order leaves out '" + m.entries[i].fqn + "', which has a path";
  return "";
}

}  // namespace fsdp::state::dcp::model_detail

namespace fsdp::state::dcp {

const Entry* Metadata::find(const std::string& fqn) const {
  for (const Entry& e : entries)
    if (e.fqn == fqn) return &e;
  return nullptr;
}

bool is_known_dtype(std::string_view name) {
  return std::find(std::begin(model_detail::kDtypes), std::end(model_detail::kDtypes), name) !=
         std::end(model_detail::kDtypes);
}

std::string metadata_problem(const Metadata& m) {
  std::unordered_set<std::string_view> seen;
  for (const Entry& e : m.entries) {
    if (!seen.insert(e.fqn).second) return "'" + e.fqn + "' appears twice";
    if (std::string p = model_detail::entry_problem(e); !p.empty()) return "'" + e.fqn + "': " + p;
  }
  return model_detail::planner_order_problem(m);
}

bool operator==(const Chunk& a, const Chunk& b) { return a.offsets == b.offsets && a.sizes == b.sizes; }

bool operator==(const StorageInfo& a, const StorageInfo& b) {
  return a.relative_path == b.relative_path && a.offset == b.offset && a.length == b.length &&
         a.transformed == b.transformed && a.transform_descriptors == b.transform_descriptors;
}

bool operator==(const PathPart& a, const PathPart& b) {
  return a.is_index == b.is_index && (a.is_index ? a.index == b.index : a.key == b.key);
}

bool operator==(const Entry& a, const Entry& b) {
  return a.fqn == b.fqn && a.is_tensor == b.is_tensor && a.size == b.size && a.dtype == b.dtype &&
         a.requires_grad == b.requires_grad && a.pin_memory == b.pin_memory && a.chunks == b.chunks &&
         a.storage == b.storage && a.path == b.path;
}

bool operator==(const Metadata& a, const Metadata& b) {
  return a.entries == b.entries && a.version == b.version && a.save_id == b.save_id &&
         a.checkpoint_id == b.checkpoint_id && a.load_id == b.load_id && a.modules == b.modules &&
         a.planner_order == b.planner_order;
}

}  // namespace fsdp::state::dcp
