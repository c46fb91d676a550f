// The safetensors format without torch (src/state/safetensors_format.h): headers written by
// serialize_header, given tensor bytes and read back by parse_header; the header's padding and
// bytes against the reference implementation's; every malformed file parse_header must refuse,
// each refused with a message that names the file, the tensor and the problem; the index of a
// sharded set, written and read back, and its malformed forms.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "state/safetensors_format.h"
#include "harness/error_of.h"

using fsdp::testing::error_of;

namespace {

namespace st = fsdp::state::safetensors;
using st::Dtype;
using st::TensorSpec;

// A directory under /tmp, removed with its files when the test ends.
class ScratchDir {
 public:
  ScratchDir() {
    std::string p = "/tmp/fsdp-safetensors-XXXXXX";
    if (::mkdtemp(p.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + std::string(std::strerror(errno)));
    path_ = p;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  // Writes `bytes` to a file of this directory; returns its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string p = path_ + "/" + name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};


std::string le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// A file of the format around `header` (JSON, unpadded) with `data_bytes` bytes of data.
std::string file_of(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x5a');
}

// Byte i of the data section of the round-trip file.
char pattern(int64_t i) { return static_cast<char>((i * 7 + 3) & 0xff); }

TEST(SafetensorsDtype, NamesBitsAndSizes) {
  for (const char* name : {"BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16",
                           "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"}) {
    const auto d = st::dtype_from_name(name);
    ASSERT_TRUE(d.has_value()) << name;
    EXPECT_STREQ(st::dtype_name(*d), name);
  }
  EXPECT_FALSE(st::dtype_from_name("float32").has_value());  // torch's names are not the format's
  EXPECT_FALSE(st::dtype_from_name("f32").has_value());
  EXPECT_EQ(st::dtype_size(Dtype::F32), 4);
  EXPECT_EQ(st::dtype_size(Dtype::BF16), 2);
  EXPECT_EQ(st::dtype_size(Dtype::BOOL), 1);
  EXPECT_EQ(st::dtype_size(Dtype::C64), 8);
  EXPECT_EQ(st::dtype_size(Dtype::I64), 8);
  EXPECT_EQ(st::dtype_bits(Dtype::F4), 4);
  EXPECT_EQ(st::dtype_bits(Dtype::F6_E3M2), 6);
  EXPECT_NE(error_of([] { st::dtype_size(Dtype::F4); }).find("not whole bytes"), std::string::npos);
  EXPECT_EQ(st::tensor_nbytes(Dtype::F32, {2, 3}), 24);
  EXPECT_EQ(st::tensor_nbytes(Dtype::F32, {}), 4);  // a scalar is one element
  EXPECT_EQ(st::tensor_nbytes(Dtype::F16, {5, 0}), 0);
  EXPECT_EQ(st::tensor_nbytes(Dtype::F4, {3, 2}), 3);
  EXPECT_NE(error_of([] { st::tensor_nbytes(Dtype::F4, {3}); }).find("ends inside a byte"), std::string::npos);
  EXPECT_NE(error_of([] { st::tensor_nbytes(Dtype::F32, {2, -1}); }).find("negative"), std::string::npos);
  EXPECT_NE(error_of([] { st::tensor_nbytes(Dtype::F64, {int64_t(1) << 40, int64_t(1) << 40}); }).find("int64"),
            std::string::npos);
}

TEST(SafetensorsHeader, RoundTripWithData) {
  const std::vector<TensorSpec> specs = {
      {"model.embed.weight", Dtype::BF16, {4, 3}}, {"model.norm.bias", Dtype::F32, {5}},
      {"empty", Dtype::F16, {0, 7}},               {"step", Dtype::I64, {}},
      {"mask", Dtype::BOOL, {3}},                  {"z.last", Dtype::F64, {1, 2}},
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "caf\xc3\xa9"}};
  const std::string header = st::serialize_header(specs, metadata);
  const auto offsets = st::data_offsets_of(specs);
  ASSERT_EQ(offsets.size(), specs.size());
  EXPECT_EQ(header.size() % 8, 0u);
  const int64_t data_bytes = offsets.back().second;
  EXPECT_EQ(data_bytes, 24 + 20 + 0 + 8 + 3 + 16);
  std::string data(static_cast<size_t>(data_bytes), '\0');
  for (int64_t i = 0; i < data_bytes; ++i) data[i] = pattern(i);
  ScratchDir dir;
  const std::string path = dir.write("model.safetensors", header + data);

  const st::Header h = st::parse_header(path);
  EXPECT_EQ(h.data_start, static_cast<int64_t>(header.size()));
  EXPECT_EQ(h.file_size, static_cast<int64_t>(header.size()) + data_bytes);
  EXPECT_EQ(h.metadata, metadata);
  ASSERT_EQ(h.tensors.size(), specs.size());
  std::ifstream in(path, std::ios::binary);
  for (size_t i = 0; i < specs.size(); ++i) {  // in file order, which is the order written
    const st::TensorEntry& t = h.tensors[i];
    EXPECT_EQ(t.name, specs[i].name);
    EXPECT_EQ(t.dtype, specs[i].dtype);
    EXPECT_EQ(t.shape, specs[i].shape);
    EXPECT_EQ(t.begin, h.data_start + offsets[i].first) << t.name;
    EXPECT_EQ(t.end, h.data_start + offsets[i].second) << t.name;
    std::string bytes(static_cast<size_t>(t.end - t.begin), '\0');
    in.seekg(t.begin);
    in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    for (size_t k = 0; k < bytes.size(); ++k)
      ASSERT_EQ(bytes[k], pattern(offsets[i].first + static_cast<int64_t>(k))) << t.name << " byte " << k;
  }
}

TEST(SafetensorsHeader, PaddedWithSpacesToEightBytes) {
  for (size_t len = 1; len <= 9; ++len) {
    const std::string name(len, 'w');
    const std::string header = st::serialize_header({{name, Dtype::F32, {2}}});
    ASSERT_EQ(header.size() % 8, 0u) << name;
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(header[i]);
    ASSERT_EQ(n, header.size() - 8);
    const std::string text = header.substr(8);
    const size_t json_end = text.rfind('}') + 1;
    EXPECT_LT(text.size() - json_end, 8u);
    EXPECT_EQ(text.substr(json_end), std::string(text.size() - json_end, ' ')) << name;
    ScratchDir dir;
    const st::Header h = st::parse_header(dir.write("p.safetensors", header + std::string(8, '\0')));
    EXPECT_EQ(h.tensors.at(0).begin % 8, 0);
  }
}

// The bytes the reference implementation writes for the same tensors (its own tests'
// expectations: the entry's keys in the order dtype, shape, data_offsets; the metadata first).
TEST(SafetensorsHeader, SameBytesAsTheReference) {
  EXPECT_EQ(st::serialize_header({}), le64(8) + "{}      ");
  EXPECT_EQ(st::serialize_header({}, {{"framework", "pt"}}), le64(40) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
  EXPECT_EQ(st::serialize_header({{"attn.0", Dtype::F32, {1, 2, 3}}}),
            le64(64) + R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})");
  EXPECT_EQ(st::serialize_header({{"attn0", Dtype::F32, {1, 1, 2, 3}}}),
            le64(72) + R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" + "       ");
}

TEST(SafetensorsHeader, AcceptsWhatTheReferenceAccepts) {
  ScratchDir dir;
  // No tensors at all; unpadded, with leading white space, in any key order, extra entry keys.
  EXPECT_TRUE(st::parse_header(dir.write("a", file_of("{}", 0))).tensors.empty());
  const st::Header h = st::parse_header(dir.write(
      "b", file_of(R"(  {"z":{"data_offsets":[0,4],"shape":[],"dtype":"I32","extra":1},)"
                   R"("a":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},"__metadata__":null})",
                   6)));
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "z");  // file order, not name order
  EXPECT_EQ(h.tensors[1].name, "a");
  EXPECT_TRUE(h.metadata.empty());
}

struct Malformed {
  const char* what;
  std::string bytes;
  std::vector<std::string> expected;  // parts of the message
};

std::vector<Malformed> malformed_files() {
  const auto entry = [](const char* name, const char* dtype, const char* shape, const char* offsets) {
    return std::string("\"") + name + R"(":{"dtype":")" + dtype + R"(","shape":)" + shape +
           R"(,"data_offsets":)" + offsets + "}";
  };
  const std::string a8 = entry("a", "F32", "[2]", "[0,8]");
  return {
      {"short", std::string("\x10\0\0\0\0", 5), {"is 5 bytes, shorter than the 8-byte header length"}},
      {"huge_length", le64(200'000'000) + "{}", {"200000000 bytes, over the format's limit of 100000000"}},
      {"length_past_end", le64(64) + "{}", {"64 bytes but only 2 follow it", "truncated"}},
      {"not_json", file_of("{\"a\":", 0), {"the header is not valid JSON"}},
      {"bad_utf8", file_of("{\"\xff\":1}", 0), {"the header is not valid JSON"}},
      {"array", file_of("[1,2]", 0), {"the header is a JSON array, not an object"}},
      {"entry_not_object", file_of(R"({"w":3})", 0), {"tensor 'w'", ": its entry is a JSON number"}},
      {"no_dtype", file_of(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", 1), {"tensor 'w' has no \"dtype\""}},
      {"unknown_dtype", file_of("{" + entry("w", "F31", "[1]", "[0,4]") + "}", 4),
       {"tensor 'w' has the unknown dtype \"F31\"", "BF16"}},
      {"negative_shape", file_of("{" + entry("w", "F32", "[2,-1]", "[0,0]") + "}", 0),
       {"tensor 'w'", "shape [2,-1] has -1, not a non-negative integer"}},
      {"float_shape", file_of("{" + entry("w", "F32", "[2.5]", "[0,8]") + "}", 8), {"tensor 'w'", "shape [2.5] has 2.5"}},
      {"shape_not_array", file_of("{" + entry("w", "F32", "4", "[0,16]") + "}", 16),
       {"tensor 'w'", "shape is 4, not an array of dimensions"}},
      {"offsets_one_number", file_of("{" + entry("w", "U8", "[1]", "[0]") + "}", 1),
       {"tensor 'w'", ": data_offsets hold 1 number(s), not the 2 of [begin, end]"}},
      {"offsets_not_integers", file_of("{" + entry("w", "U8", "[1]", "[0,\"1\"]") + "}", 1),
       {"tensor 'w'", "data_offsets [0,\"1\"] has \"1\""}},
      {"end_before_begin", file_of("{" + entry("w", "U8", "[4]", "[8,4]") + "}", 8),
       {"tensor 'w'", "data_offsets [8, 4] end before they begin"}},
      {"past_end", file_of("{" + entry("w", "F32", "[25]", "[0,100]") + "}", 8),
       {"tensor 'w'", "[0, 100] run past the end of the file", "holds 8 bytes"}},
      {"overlap", file_of("{" + a8 + "," + entry("b", "F32", "[2]", "[4,12]") + "}", 12),
       {"tensor 'b'", "[4, 12] overlap those of tensor 'a'", "[0, 8]"}},
      {"gap", file_of("{" + a8 + "," + entry("b", "F32", "[2]", "[12,20]") + "}", 20),
       {"bytes [8, 12] of the data section belong to no tensor", "before 'b'"}},
      {"not_from_zero", file_of("{" + entry("a", "F32", "[2]", "[4,12]") + "}", 12),
       {"bytes [0, 4] of the data section belong to no tensor", "before 'a'"}},
      {"trailing_bytes", file_of("{" + a8 + "}", 12),
       {"ends at byte 8 of the data section, which holds 12 bytes", "not fully covered"}},
      {"wrong_length", file_of("{" + entry("a", "F32", "[3]", "[0,8]") + "}", 8),
       {"tensor 'a'", "hold 8 bytes, but dtype F32 and shape [3] need 12"}},
      {"sub_byte", file_of("{" + entry("a", "F4", "[3]", "[0,2]") + "}", 2), {"tensor 'a'", "ends inside a byte"}},
      {"overflow", file_of("{" + entry("a", "F64", "[4611686018427387904,4]", "[0,8]") + "}", 8),
       {"tensor 'a'", "its size in bits overflows int64"}},
      {"duplicate_name", file_of("{" + a8 + "," + entry("a", "F32", "[2]", "[8,16]") + "}", 16),
       {"tensor 'a' appears twice in the header"}},
      {"duplicate_field", file_of(R"({"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}})", 8),
       {"the key 'dtype' appears twice in 'a'"}},
      {"metadata_number", file_of(R"({"__metadata__":{"epoch":3}})", 0),
       {"\"__metadata__\" entry 'epoch' is a JSON number", "must be strings"}},
      {"metadata_array", file_of(R"({"__metadata__":["x"]})", 0), {"\"__metadata__\" is a JSON array"}},
  };
}

TEST(SafetensorsHeader, RefusesEveryMalformedFileByName) {
  ScratchDir dir;
  for (const Malformed& m : malformed_files()) {
    const std::string path = dir.write(std::string(m.what) + ".safetensors", m.bytes);
    const std::string message = error_of([&] { st::parse_header(path); });
    EXPECT_EQ(message.rfind("fsdp: safetensors: '" + path + "': ", 0), 0u) << m.what << ": " << message;
    for (const std::string& part : m.expected)
      EXPECT_NE(message.find(part), std::string::npos) << m.what << ": '" << part << "' not in: " << message;
  }
  const std::string missing = dir.path() + "/missing.safetensors";
  EXPECT_NE(error_of([&] { st::parse_header(missing); }).find("'" + missing + "': cannot open it"), std::string::npos);
  EXPECT_NE(error_of([&] { st::parse_header(dir.path()); }).find("not a regular file"), std::string::npos);
}

TEST(SafetensorsHeader, SerializeRefusesWhatNoReaderCouldRead) {
  EXPECT_NE(error_of([] { st::serialize_header({{"a", Dtype::F32, {1}}, {"a", Dtype::F32, {2}}}); })
                .find("tensor 'a' is given twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { st::serialize_header({{"__metadata__", Dtype::F32, {1}}}); }).find("reserved"),
            std::string::npos);
  EXPECT_NE(error_of([] { st::serialize_header({{"w", Dtype::F32, {3, -2}}}); }).find("tensor 'w': shape [3, -2]"),
            std::string::npos);
  EXPECT_NE(error_of([] { st::serialize_header({{"w", Dtype::F4, {3}}}); }).find("ends inside a byte"),
            std::string::npos);
  EXPECT_NE(error_of([] { st::serialize_header({{"bad\xff", Dtype::F32, {1}}}); }).find("not valid UTF-8"),
            std::string::npos);
}

TEST(SafetensorsIndex, RoundTrip) {
  const std::map<std::string, std::string> weight_map = {
      {"lm_head.weight", "model-00002-of-00002.safetensors"},
      {"model.embed.weight", "model-00001-of-00002.safetensors"},
      {"model.norm.weight", "model-00002-of-00002.safetensors"},
  };
  const std::string text = st::serialize_index(weight_map, 123456789012, {{"total_parameters", 61728394506}});
  EXPECT_EQ(text.back(), '\n');
  ScratchDir dir;
  const st::Index index = st::parse_index(dir.write(st::kIndexFile, text));
  EXPECT_EQ(index.weight_map, weight_map);
  ASSERT_TRUE(index.total_size.has_value());
  EXPECT_EQ(*index.total_size, 123456789012);
  EXPECT_EQ(index.metadata.at("total_parameters"), 61728394506);
  EXPECT_EQ(index.metadata.at("total_size"), 123456789012);

  // As transformers writes one; an index without metadata has no total_size.
  const st::Index hf = st::parse_index(dir.write("hf.json", R"({
  "metadata": {"total_size": 16},
  "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
})"));
  EXPECT_EQ(hf.weight_map.at("b"), "model-00002-of-00002.safetensors");
  EXPECT_EQ(hf.total_size, 16);
  EXPECT_FALSE(st::parse_index(dir.write("bare.json", R"({"weight_map": {}})")).total_size.has_value());
}

TEST(SafetensorsIndex, RefusesMalformedIndexesByName) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {R"({"weight_map": )", {"the index is not valid JSON"}},
      {R"([])", {"the index is a JSON array"}},
      {R"({"metadata": {}})", {"the index has no \"weight_map\""}},
      {R"({"weight_map": ["a"]})", {"\"weight_map\" is a JSON array"}},
      {R"({"weight_map": {"w": 3}})", {"tensor 'w'", "file in the weight_map is 3, not a file name"}},
      {R"({"weight_map": {"w": ""}})", {"tensor 'w'", "is empty"}},
      {R"({"weight_map": {"w": "/etc/passwd"}})", {"tensor 'w'", "is an absolute path"}},
      {R"({"weight_map": {"w": "../x.safetensors"}})", {"tensor 'w'", "climbs out"}},
      {R"({"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}})", {"key 'w' appears twice"}},
      {R"({"weight_map": {}, "x": [{"k": 1}, [{"k": 1, "k": 2}]]})", {"the key 'k' appears twice in 'x' of the index"}},
      {R"({"metadata": 1, "weight_map": {}})", {"\"metadata\" is a JSON number"}},
      {R"({"metadata": {"total_size": -1}, "weight_map": {}})", {"total_size is -1, not a non-negative"}},
      {R"({"metadata": {"total_size": "16"}, "weight_map": {}})", {"total_size is \"16\""}},
  };
  ScratchDir dir;
  int i = 0;
  for (const auto& [text, parts] : cases) {
    const std::string path = dir.write("index" + std::to_string(i++) + ".json", text);
    const std::string message = error_of([&] { st::parse_index(path); });
    EXPECT_EQ(message.rfind("fsdp: safetensors: '" + path + "': ", 0), 0u) << text << ": " << message;
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << text << ": '" << part << "' not in: " << message;
  }
  EXPECT_NE(error_of([&] { st::parse_index(dir.path() + "/none.json"); }).find("cannot open the index"),
            std::string::npos);
  EXPECT_NE(error_of([] { st::serialize_index({{"w", "../up.safetensors"}}, 0); }).find("tensor 'w'"),
            std::string::npos);
  EXPECT_NE(error_of([] { st::serialize_index({}, -3); }).find("cannot be negative"), std::string::npos);
}

}  // namespace
