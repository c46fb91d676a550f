#include "safetensors_format.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

// The state layer is compiled as a unity build: this file's helpers live in a named
// namespace of their own, not an anonymous one that another file's could collide with.
namespace fsdp::state::safetensors::detail {

using nlohmann::json;

struct DtypeInfo {
  Dtype dtype;
  const char* name;
  int bits;
};
constexpr DtypeInfo kDtypes[] = {
    {Dtype::BOOL, "BOOL", 8},   {Dtype::F4, "F4", 4},           {Dtype::F6_E2M3, "F6_E2M3", 6},
    {Dtype::F6_E3M2, "F6_E3M2", 6}, {Dtype::U8, "U8", 8},         {Dtype::I8, "I8", 8},
    {Dtype::F8_E5M2, "F8_E5M2", 8}, {Dtype::F8_E4M3, "F8_E4M3", 8}, {Dtype::F8_E8M0, "F8_E8M0", 8},
    {Dtype::I16, "I16", 16},    {Dtype::U16, "U16", 16},        {Dtype::F16, "F16", 16},
    {Dtype::BF16, "BF16", 16},  {Dtype::I32, "I32", 32},        {Dtype::U32, "U32", 32},
    {Dtype::F32, "F32", 32},    {Dtype::C64, "C64", 64},        {Dtype::F64, "F64", 64},
    {Dtype::I64, "I64", 64},    {Dtype::U64, "U64", 64},
};

const DtypeInfo& info_of(Dtype d) {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i;
  throw std::invalid_argument("fsdp: safetensors: dtype #" + std::to_string(static_cast<int>(d)) +
                              " is not one of the format's");
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("fsdp: safetensors: '" + path + "': " + what);
}

std::string in_quotes(const std::string& s) { return "'" + s + "'"; }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string range_text(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// A JSON integer as an int64: std::nullopt for anything else (a float, a string, an integer
// beyond int64). Negative values are returned; callers say why they are wrong.
std::optional<int64_t> integer_of(const json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

// --- JSON whose objects have unique keys --------------------------------------------------

// nlohmann::json, like the reference's serde maps, keeps the last of two equal keys: a
// header naming a tensor twice would silently lose one of them. The parser's callback sees
// every key, object by object, and stops at the first repeated one.
struct DuplicateKey {
  std::string key, parent;  // parent: the key of the object holding it ("" at the top)
};

json parse_unique_keys(const std::string& text) {
  struct Open {  // an object or array being parsed
    std::string name;            // the key it is the value of (an array's, for its elements)
    bool is_object = false;
    std::set<std::string> keys;  // an object's keys so far
    std::string last_key;
  };
  std::vector<Open> open;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      std::string name = open.empty() ? "" : open.back().is_object ? open.back().last_key : open.back().name;
      open.push_back({std::move(name), event == E::object_start, {}, ""});
    } else if (event == E::object_end || event == E::array_end) {
      open.pop_back();
    } else if (event == E::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open.back().keys.insert(key).second) throw DuplicateKey{key, open.back().name};
      open.back().last_key = key;
    }
    return true;
  };
  return json::parse(text, callback);
}

// Parses `text` (the header or the index of `path`), refusing invalid JSON and repeated keys;
// `top_key_is` names what a top-level key is ("tensor", "key").
json parse_json(const std::string& path, const std::string& text, const char* what, const char* top_key_is) {
  try {
    return parse_unique_keys(text);
  } catch (const DuplicateKey& dup) {
    if (dup.parent.empty())
      fail(path, std::string(top_key_is) + " " + in_quotes(dup.key) + " appears twice in the " + what +
                     ": names must be unique");
    fail(path, "the key " + in_quotes(dup.key) + " appears twice in " + in_quotes(dup.parent) + " of the " + what +
                   ": keys must be unique");
  } catch (const json::exception& e) {
    fail(path, std::string("the ") + what + " is not valid JSON (" + e.what() +
                   "): the file is damaged or is not in this format");
  }
}

// --- reading the header's bytes -------------------------------------------------------------

struct RawHeader {
  std::string text;  // the N bytes of JSON (and padding)
  int64_t data_start = 0, file_size = 0;
};

class ReadOnlyFile {
 public:
  explicit ReadOnlyFile(const std::string& path) : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd_ < 0) fail(path_, std::string("cannot open it: ") + std::strerror(errno));
  }
  ~ReadOnlyFile() { ::close(fd_); }
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;

  int64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail(path_, std::string("cannot stat it: ") + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) fail(path_, "it is not a regular file");
    return static_cast<int64_t>(st.st_size);
  }
  // Exactly n bytes at `offset` (the caller knows the file holds them).
  void read(void* dst, size_t n, int64_t offset) const {
    auto* p = static_cast<char*>(dst);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd_, p + done, n - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail(path_, std::string("reading it failed: ") + std::strerror(errno));
      if (r == 0) fail(path_, "the file shrank while its header was read");
      done += static_cast<size_t>(r);
    }
  }

 private:
  std::string path_;
  int fd_;
};

uint64_t little_endian_u64(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

RawHeader read_raw_header(const std::string& path) {
  const ReadOnlyFile file(path);
  RawHeader raw;
  raw.file_size = file.size();
  if (raw.file_size < 8)
    fail(path, "the file is " + std::to_string(raw.file_size) +
                   " bytes, shorter than the 8-byte header length: it is truncated or not a safetensors file");
  unsigned char length[8];
  file.read(length, 8, 0);
  const uint64_t n = little_endian_u64(length);
  if (n > static_cast<uint64_t>(kMaxHeaderBytes))
    fail(path, "the header length is " + std::to_string(n) + " bytes, over the format's limit of " +
                   std::to_string(kMaxHeaderBytes) + ": the file is damaged or is not a safetensors file");
  if (static_cast<int64_t>(n) > raw.file_size - 8)
    fail(path, "the header length is " + std::to_string(n) + " bytes but only " + std::to_string(raw.file_size - 8) +
                   " follow it: the file is truncated or is not a safetensors file");
  raw.text.resize(static_cast<size_t>(n));
  file.read(raw.text.data(), raw.text.size(), 8);
  raw.data_start = 8 + static_cast<int64_t>(n);
  return raw;
}

// --- the header's entries -------------------------------------------------------------------

std::map<std::string, std::string> metadata_of(const std::string& path, const json& value) {
  std::map<std::string, std::string> out;
  if (value.is_null()) return out;  // the reference reads null as "no metadata"
  if (!value.is_object())
    fail(path, std::string("\"") + kMetadataKey + "\" is a JSON " + value.type_name() +
                   ", not an object of string to string");
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string())
      fail(path, std::string("\"") + kMetadataKey + "\" entry " + in_quotes(key) + " is a JSON " + v.type_name() +
                     ": metadata values must be strings");
    out[key] = v.get<std::string>();
  }
  return out;
}

const json& field_of(const std::string& path, const std::string& name, const json& entry, const char* key) {
  const auto it = entry.find(key);
  if (it == entry.end())
    fail(path, "tensor " + in_quotes(name) + " has no \"" + key + "\" (an entry holds dtype, shape and data_offsets)");
  return *it;
}

Dtype dtype_field(const std::string& path, const std::string& name, const json& entry) {
  const json& v = field_of(path, name, entry, "dtype");
  const std::optional<Dtype> d = v.is_string() ? dtype_from_name(v.get<std::string>()) : std::nullopt;
  if (!d) {
    std::string known;
    for (const auto& i : kDtypes) known += std::string(known.empty() ? "" : ", ") + i.name;
    fail(path, "tensor " + in_quotes(name) + " has the unknown dtype " + v.dump() + " (the format's are " + known + ")");
  }
  return *d;
}

// A JSON array of non-negative integers (`what` names it in messages, `rule` says what it is).
std::vector<int64_t> sizes_field(const std::string& path, const std::string& name, const json& v, const char* what,
                                 const char* rule) {
  if (!v.is_array()) fail(path, "tensor " + in_quotes(name) + ": " + what + " is " + v.dump() + ", not " + rule);
  std::vector<int64_t> out;
  for (const json& x : v) {
    const std::optional<int64_t> i = integer_of(x);
    if (!i || *i < 0)
      fail(path, "tensor " + in_quotes(name) + ": " + what + " " + v.dump() + " has " + x.dump() +
                     ", not a non-negative integer (" + what + " is " + rule + ")");
    out.push_back(*i);
  }
  return out;
}

// Checks one entry on its own; its offsets are still relative to the data section.
TensorEntry entry_of(const std::string& path, const std::string& name, const json& entry, int64_t data_bytes) {
  if (!entry.is_object())
    fail(path, "tensor " + in_quotes(name) + ": its entry is a JSON " + entry.type_name() +
                   ", not an object of dtype, shape and data_offsets");
  TensorEntry t;
  t.name = name;
  t.dtype = dtype_field(path, name, entry);
  t.shape = sizes_field(path, name, field_of(path, name, entry, "shape"), "shape", "an array of dimensions");
  const std::vector<int64_t> offsets =
      sizes_field(path, name, field_of(path, name, entry, "data_offsets"), "data_offsets", "a [begin, end] pair");
  if (offsets.size() != 2)
    fail(path, "tensor " + in_quotes(name) + ": data_offsets hold " + std::to_string(offsets.size()) +
                   " number(s), not the 2 of [begin, end]");
  t.begin = offsets[0];
  t.end = offsets[1];
  if (t.end < t.begin)
    fail(path, "tensor " + in_quotes(name) + ": data_offsets " + range_text(t.begin, t.end) + " end before they begin");
  if (t.end > data_bytes)
    fail(path, "tensor " + in_quotes(name) + ": data_offsets " + range_text(t.begin, t.end) +
                   " run past the end of the file (its data section holds " + std::to_string(data_bytes) +
                   " bytes): the file is truncated");
  return t;
}

void check_size(const std::string& path, const TensorEntry& t) {
  int64_t nbytes = 0;
  try {
    nbytes = tensor_nbytes(t.dtype, t.shape);
  } catch (const std::invalid_argument& e) {
    fail(path, "tensor " + in_quotes(t.name) + ": " + e.what());
  }
  if (t.end - t.begin != nbytes)
    fail(path, "tensor " + in_quotes(t.name) + ": data_offsets " + range_text(t.begin, t.end) + " hold " +
                   std::to_string(t.end - t.begin) + " bytes, but dtype " + dtype_name(t.dtype) + " and shape " +
                   shape_text(t.shape) + " need " + std::to_string(nbytes));
}

// Sorted by offset, the ranges must tile [0, data_bytes): no gap, no overlap, nothing left.
void check_tiling(const std::string& path, const std::vector<TensorEntry>& sorted, int64_t data_bytes) {
  int64_t covered = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& t : sorted) {
    if (t.begin > covered)
      fail(path, "bytes " + range_text(covered, t.begin) + " of the data section belong to no tensor (a gap before " +
                     in_quotes(t.name) + "): tensors' data must be contiguous");
    if (t.begin < covered)
      fail(path, "tensor " + in_quotes(t.name) + ": data_offsets " + range_text(t.begin, t.end) + " overlap those of tensor " +
                     in_quotes(previous->name) + ", " + range_text(previous->begin, previous->end) +
                     ": each byte of the data section belongs to one tensor");
    covered = t.end;
    previous = &t;
  }
  if (covered != data_bytes)
    fail(path, "the tensors' data ends at byte " + std::to_string(covered) + " of the data section, which holds " +
                   std::to_string(data_bytes) + " bytes: the data section is not fully covered (bytes after the last " +
                   "tensor, or a tensor missing from the header)");
}

// --- writing -------------------------------------------------------------------------------

// A string JSON can carry (UTF-8); `what` names it in the message otherwise.
void check_utf8(const std::string& s, const std::string& what) {
  try {
    (void)json(s).dump();
  } catch (const json::exception&) {
    throw std::invalid_argument("fsdp: safetensors: " + what + " is not valid UTF-8, which a JSON header cannot hold");
  }
}

void check_specs(const std::vector<TensorSpec>& tensors) {
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = tensors[i].name;
    check_utf8(name, "the name of tensor #" + std::to_string(i));
    if (name == kMetadataKey)
      throw std::invalid_argument(std::string("fsdp: safetensors: a tensor cannot be named ") + kMetadataKey +
                                  " (the key is reserved for the metadata)");
    if (!names.insert(name).second)
      throw std::invalid_argument("fsdp: safetensors: tensor " + in_quotes(name) + " is given twice: names must be unique");
  }
}

std::string little_endian_bytes(uint64_t v) {
  std::string out(8, '\0');
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// --- the index -----------------------------------------------------------------------------

// Why a file name is unfit for an index ("" when it is fine): the loader opens it beside the
// index, so it must not climb out of that directory or name another place.
std::string file_name_problem(const std::string& file) {
  if (file.empty()) return "is empty";
  if (file.find('\0') != std::string::npos) return "holds a NUL character";
  if (file.front() == '/') return "is an absolute path (the files of a set lie beside its index)";
  std::stringstream parts(file);
  for (std::string part; std::getline(parts, part, '/');)
    if (part == "..") return "climbs out of the index's directory with \"..\"";
  return "";
}

std::map<std::string, std::string> weight_map_of(const std::string& path, const json& j) {
  const auto it = j.find("weight_map");
  if (it == j.end()) fail(path, "the index has no \"weight_map\" (the object of tensor name to file name)");
  if (!it->is_object())
    fail(path, std::string("the index's \"weight_map\" is a JSON ") + it->type_name() +
                   ", not an object of tensor name to file name");
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : it->items()) {
    if (!file.is_string())
      fail(path, "tensor " + in_quotes(name) + ": its file in the weight_map is " + file.dump() + ", not a file name");
    const std::string problem = file_name_problem(file.get<std::string>());
    if (!problem.empty())
      fail(path, "tensor " + in_quotes(name) + ": its file " + file.dump() + " in the weight_map " + problem);
    out[name] = file.get<std::string>();
  }
  return out;
}

// total_size as written by transformers (an integer); a whole-valued float is taken too, as
// some converters write one.
std::optional<int64_t> total_size_of(const std::string& path, const json& metadata) {
  const auto it = metadata.find("total_size");
  if (it == metadata.end()) return std::nullopt;
  std::optional<int64_t> size = integer_of(*it);
  if (!size && it->is_number_float()) {
    const double d = it->get<double>();
    if (d >= 0 && d < 9.2e18 && d == static_cast<double>(static_cast<int64_t>(d))) size = static_cast<int64_t>(d);
  }
  if (!size || *size < 0)
    fail(path, "the index's metadata.total_size is " + it->dump() + ", not a non-negative integer number of bytes");
  return size;
}

}  // namespace fsdp::state::safetensors::detail

namespace fsdp::state::safetensors {

using detail::fail;
using detail::in_quotes;
using nlohmann::json;

std::optional<Dtype> dtype_from_name(const std::string& name) {
  for (const auto& i : detail::kDtypes)
    if (name == i.name) return i.dtype;
  return std::nullopt;
}

const char* dtype_name(Dtype d) { return detail::info_of(d).name; }
int dtype_bits(Dtype d) { return detail::info_of(d).bits; }

int64_t dtype_size(Dtype d) {
  const int bits = dtype_bits(d);
  if (bits % 8 != 0)
    throw std::invalid_argument(std::string("fsdp: safetensors: ") + dtype_name(d) + " elements are " +
                                std::to_string(bits) + " bits, not whole bytes (use dtype_bits)");
  return bits / 8;
}

int64_t tensor_nbytes(Dtype d, const std::vector<int64_t>& shape) {
  int64_t bits = dtype_bits(d);
  for (const int64_t s : shape) {
    if (s < 0) throw std::invalid_argument("shape " + detail::shape_text(shape) + " has a negative dimension");
    if (__builtin_mul_overflow(bits, s, &bits))
      throw std::invalid_argument("shape " + detail::shape_text(shape) + " of " + dtype_name(d) +
                                  " is too large: its size in bits overflows int64");
  }
  if (bits % 8 != 0)
    throw std::invalid_argument("shape " + detail::shape_text(shape) + " of " + dtype_name(d) + " is " +
                                std::to_string(bits) + " bits, which ends inside a byte");
  return bits / 8;
}

Header parse_header(const std::string& path) {
  const detail::RawHeader raw = detail::read_raw_header(path);
  const json j = detail::parse_json(path, raw.text, "header", "tensor");
  if (!j.is_object())
    fail(path, std::string("the header is a JSON ") + j.type_name() + ", not an object of tensor name to entry");
  Header h;
  h.data_start = raw.data_start;
  h.file_size = raw.file_size;
  const int64_t data_bytes = raw.file_size - raw.data_start;
  for (const auto& [name, value] : j.items()) {
    if (name == kMetadataKey) h.metadata = detail::metadata_of(path, value);
    else h.tensors.push_back(detail::entry_of(path, name, value, data_bytes));
  }
  // File order; equal offsets (empty tensors) stay in name order, as the JSON object gave them.
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::make_pair(a.begin, a.end) < std::make_pair(b.begin, b.end);
  });
  detail::check_tiling(path, h.tensors, data_bytes);
  for (TensorEntry& t : h.tensors) {
    detail::check_size(path, t);
    t.begin += h.data_start;
    t.end += h.data_start;
  }
  return h;
}

std::vector<std::pair<int64_t, int64_t>> data_offsets_of(const std::vector<TensorSpec>& tensors) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;
  for (const TensorSpec& t : tensors) {
    int64_t nbytes = 0;
    try {
      nbytes = tensor_nbytes(t.dtype, t.shape);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("fsdp: safetensors: tensor " + in_quotes(t.name) + ": " + e.what());
    }
    if (__builtin_add_overflow(at, nbytes, &at))
      throw std::invalid_argument("fsdp: safetensors: the tensors up to " + in_quotes(t.name) +
                                  " hold more bytes than an int64 counts");
    out.emplace_back(at - nbytes, at);
  }
  return out;
}

std::string serialize_header(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata) {
  detail::check_specs(tensors);
  for (const auto& [key, value] : metadata) {
    detail::check_utf8(key, "metadata key " + in_quotes(key));
    detail::check_utf8(value, "the value of metadata key " + in_quotes(key));
  }
  const auto offsets = data_offsets_of(tensors);
  // ordered_json: the metadata first, then the tensors in file order, as the reference writes.
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) j[kMetadataKey] = metadata;
  for (size_t i = 0; i < tensors.size(); ++i)
    j[tensors[i].name] = {{"dtype", dtype_name(tensors[i].dtype)},
                          {"shape", tensors[i].shape},
                          {"data_offsets", {offsets[i].first, offsets[i].second}}};
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // [Note: safetensors]: data aligned to 8 in the file
  return detail::little_endian_bytes(text.size()) + text;
}

Index parse_index(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open the index: ") + std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  const json j = detail::parse_json(path, text.str(), "index", "key");
  if (!j.is_object())
    fail(path, std::string("the index is a JSON ") + j.type_name() + ", not an object with a \"weight_map\"");
  Index index;
  index.weight_map = detail::weight_map_of(path, j);
  const auto meta = j.find("metadata");
  if (meta != j.end() && !meta->is_null()) {
    if (!meta->is_object())
      fail(path, std::string("the index's \"metadata\" is a JSON ") + meta->type_name() + ", not an object");
    index.metadata = *meta;
    index.total_size = detail::total_size_of(path, *meta);
  }
  return index;
}

std::string serialize_index(const std::map<std::string, std::string>& weight_map, int64_t total_size,
                            const json& extra_metadata) {
  if (!extra_metadata.is_object())
    throw std::invalid_argument(std::string("fsdp: safetensors: an index's metadata must be a JSON object, not a ") +
                                extra_metadata.type_name());
  if (total_size < 0)
    throw std::invalid_argument("fsdp: safetensors: an index's total_size cannot be negative (" +
                                std::to_string(total_size) + ")");
  for (const auto& [name, file] : weight_map) {
    detail::check_utf8(name, "tensor name " + in_quotes(name));
    detail::check_utf8(file, "file name " + in_quotes(file));
    const std::string problem = detail::file_name_problem(file);
    if (!problem.empty())
      throw std::invalid_argument("fsdp: safetensors: tensor " + in_quotes(name) + ": its file " + in_quotes(file) + " " + problem);
  }
  json metadata = extra_metadata;
  metadata["total_size"] = total_size;
  // As transformers writes it: sorted keys, two-space indent, a final newline.
  return json{{"metadata", metadata}, {"weight_map", weight_map}}.dump(2) + "\n";
}

}  // namespace fsdp::state::safetensors
