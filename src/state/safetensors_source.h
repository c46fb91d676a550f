#pragma once
// Internal to src/state: the tensors of a safetensors file or sharded set, opened for reading
// by byte range ([Note: loading safetensors] in include/fsdp/state/safetensors.h). Only the
// headers are read when it opens; read_range reads the bytes of a run of elements.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "safetensors_format.h"

namespace fsdp::state {

/// The torch dtype of a safetensors dtype; std::nullopt for those torch has no dtype for
/// (F4, F6_*, F8_E8M0).
std::optional<at::ScalarType> scalar_type_of(safetensors::Dtype d);
/// The safetensors dtype of a torch dtype; std::nullopt for those the format lacks.
std::optional<safetensors::Dtype> safetensors_dtype_of(at::ScalarType t);

class SafetensorsSource {
 public:
  /// `path`: a .safetensors file, an index (.json), or a directory holding
  /// model.safetensors.index.json or model.safetensors. Throws naming the path and what is
  /// wrong (a missing file, a header parse_header refuses, an index naming a tensor its file
  /// lacks).
  explicit SafetensorsSource(const std::string& path);
  ~SafetensorsSource();
  SafetensorsSource(const SafetensorsSource&) = delete;
  SafetensorsSource& operator=(const SafetensorsSource&) = delete;

  struct Tensor {
    const safetensors::TensorEntry* entry = nullptr;
    size_t file = 0;  // index into files()
  };
  /// Every tensor name, files in order, each file's tensors by offset.
  const std::vector<std::string>& names() const { return names_; }
  const Tensor* find(const std::string& name) const;
  const std::string& path() const { return path_; }
  /// What load errors name: the path given, and the file when it is a set.
  std::string where(const Tensor& t) const;

  /// Elements [begin, end) of the flattened tensor, converted into `dest` (a contiguous
  /// tensor of end - begin elements, any dtype and device). Returns the bytes read.
  int64_t read_range(const Tensor& t, int64_t begin, int64_t end, const at::Tensor& dest) const;
  /// The whole tensor, in its own dtype, on the host.
  at::Tensor read_whole(const Tensor& t) const;

 private:
  struct File {
    std::string path;
    safetensors::Header header;
    int fd = -1;
  };
  std::string path_;
  bool is_set_ = false;
  std::vector<File> files_;
  std::vector<std::string> names_;
  std::map<std::string, Tensor> by_name_;

  void open_file(const std::string& path);
  void open_set(const std::string& index_path);
  void pread_all(const Tensor& t, char* dst, int64_t nbytes, int64_t offset) const;
};

}  // namespace fsdp::state
