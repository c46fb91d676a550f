#pragma once
// The safetensors file format (Hugging Face's), without torch: a file's header, read and
// checked; a header to write before the tensors' bytes; the index of a sharded set. The
// loader and the writer of issue 53 ("Weights in and out") are built on these.
//
// [Note: safetensors]
// A file is: 8 bytes, a little-endian u64 N; N bytes of UTF-8 JSON, the header; the data
// section, every byte after the header. The header is one object mapping each tensor name to
// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, plus an optional
// "__metadata__" object of string to string. Offsets count from the start of the data
// section (so a tensor's bytes lie at 8 + N + begin in the file); its bytes are row-major,
// little-endian. Writers pad the header with spaces to a multiple of 8 bytes, so that every
// tensor whose offset is aligned in the data section is aligned in the file too.
//
// What a reader checks, as the reference implementation (huggingface/safetensors,
// Metadata::validate) does: N is at most 100 MB (a corrupt length must not make us allocate
// gigabytes) and within the file; the header is a JSON object; sorted by offset, the ranges
// start at 0 and each begins where the previous one ends, with no gap and no overlap, and the
// last ends at the end of the file; each range holds exactly numel * bits / 8 bytes (a whole
// number of bytes: F4 and F6 tensors pack several elements per byte). The tensors' order in
// the JSON means nothing: the offsets give the file order. We also refuse what the
// reference silently accepts because its JSON maps keep the last value: a name, or a key of
// an entry, that appears twice. Unknown keys in an entry are ignored, as there.
//
// Why only the header is read here. A checkpoint in this format is read by every rank, and a
// rank needs only its shard of each tensor: with the header's absolute offsets
// (TensorEntry::begin), a rank preads just the byte ranges that overlap its shard (one range
// per tensor that crosses its piece of the flat parameter), instead of every rank reading, or
// mapping and touching, the whole file. The header is all a rank reads in full, which is why
// parse_header checks everything the ranges depend on before any of them is read. The data
// itself carries no checksum in this format: what a reader can check is that the ranges are
// consistent with the file, and parse_header does.
//
// A sharded set is several such files and a JSON index, model.safetensors.index.json:
// {"metadata": {"total_size": <bytes of tensor data in all files>}, "weight_map": {tensor
// name: file name, ...}}, file names relative to the index's directory.
//
// Errors are std::runtime_error whose message starts "fsdp: safetensors: '<path>': " and
// names the tensor (or key) that is wrong and what would make it right.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace fsdp::state::safetensors {

/// The dtypes of the format, by their names in the header.
enum class Dtype {
  BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0,
  I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64,
};

/// The dtype named `name` ("F32", "BF16", ...); std::nullopt for a name the format lacks.
std::optional<Dtype> dtype_from_name(const std::string& name);
const char* dtype_name(Dtype d);
/// Bits per element: 4 (F4) and 6 (F6_*) are below a byte; the others are whole bytes.
int dtype_bits(Dtype d);
/// Bytes per element; throws std::invalid_argument for F4 and F6_* (use dtype_bits).
int64_t dtype_size(Dtype d);
/// Bytes of a tensor of `shape`; throws std::invalid_argument (saying why) for a negative
/// dimension, a size that overflows int64, or sub-byte elements that end inside a byte.
int64_t tensor_nbytes(Dtype d, const std::vector<int64_t>& shape);

constexpr int64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's bound on N
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kIndexFile = "model.safetensors.index.json";

struct TensorEntry {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // absolute file offsets of the tensor's bytes: [begin, end)
};

struct Header {
  std::vector<TensorEntry> tensors;  // in file order (by offset)
  std::map<std::string, std::string> metadata;  // "__metadata__"; empty when absent
  int64_t data_start = 0;  // 8 + N: where the data section begins
  int64_t file_size = 0;
};

/// Reads and checks the header of the safetensors file at `path` (not its data): every rule
/// of [Note: safetensors]. Throws std::runtime_error naming the file and the tensor.
Header parse_header(const std::string& path);

/// One tensor a writer will store, in the order it will store them.
struct TensorSpec {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
};

/// The first bytes of a safetensors file holding `tensors` in the order given: the 8-byte
/// length and the JSON header, padded with spaces to a multiple of 8. The writer then writes
/// each tensor's bytes, in that order, with nothing between them (data_offsets_of says where
/// each goes). Throws std::invalid_argument for a duplicate or reserved name, a name that is
/// not UTF-8, a negative dimension, or a size that tensor_nbytes refuses.
std::string serialize_header(const std::vector<TensorSpec>& tensors,
                             const std::map<std::string, std::string>& metadata = {});

/// Each tensor's [begin, end) in the data section (relative: add the header's size for the
/// file offset), laid out consecutively in the order given, as serialize_header writes them.
std::vector<std::pair<int64_t, int64_t>> data_offsets_of(const std::vector<TensorSpec>& tensors);

/// The index of a sharded set ([Note: safetensors]).
struct Index {
  std::map<std::string, std::string> weight_map;  // tensor name -> file name
  std::optional<int64_t> total_size;              // "metadata"."total_size", when present
  nlohmann::json metadata = nlohmann::json::object();  // the whole "metadata" object, as read
};

/// Reads and checks an index: a JSON object with a "weight_map" object of tensor name to
/// file name (relative, without ".." and without a duplicate name) and an optional
/// "metadata" object whose "total_size", when present, is a non-negative integer.
Index parse_index(const std::string& path);

/// The text of an index: `weight_map`, and "metadata" holding `extra_metadata`'s keys and
/// total_size. Throws std::invalid_argument for a file name parse_index would refuse.
std::string serialize_index(const std::map<std::string, std::string>& weight_map, int64_t total_size,
                            const nlohmann::json& extra_metadata = nlohmann::json::object());

}  // namespace fsdp::state::safetensors
