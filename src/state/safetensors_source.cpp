#include "safetensors_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fsdp::state {

namespace safetensors_source_detail {

using safetensors::Dtype;

struct DtypePair {
  Dtype file;
  at::ScalarType torch;
};
constexpr DtypePair kPairs[] = {
    {Dtype::BOOL, at::kBool},       {Dtype::U8, at::kByte},         {Dtype::I8, at::kChar},
    {Dtype::I16, at::kShort},       {Dtype::U16, at::kUInt16},      {Dtype::F16, at::kHalf},
    {Dtype::BF16, at::kBFloat16},   {Dtype::I32, at::kInt},         {Dtype::U32, at::kUInt32},
    {Dtype::F32, at::kFloat},       {Dtype::C64, at::kComplexFloat}, {Dtype::F64, at::kDouble},
    {Dtype::I64, at::kLong},        {Dtype::U64, at::kUInt64},      {Dtype::F8_E5M2, at::kFloat8_e5m2},
    {Dtype::F8_E4M3, at::kFloat8_e4m3fn}, {Dtype::F8_E8M0, at::kFloat8_e8m0fnu},
};

// The host buffer a converted or device-bound range goes through, chunk by chunk.
constexpr int64_t kStagingBytes = int64_t(16) << 20;

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace safetensors_source_detail

std::optional<at::ScalarType> scalar_type_of(safetensors::Dtype d) {
  for (const auto& p : safetensors_source_detail::kPairs)
    if (p.file == d) return p.torch;
  return std::nullopt;
}

std::optional<safetensors::Dtype> safetensors_dtype_of(at::ScalarType t) {
  for (const auto& p : safetensors_source_detail::kPairs)
    if (p.torch == t) return p.file;
  return std::nullopt;
}

SafetensorsSource::SafetensorsSource(const std::string& path) : path_(path) {
  namespace d = safetensors_source_detail;
  if (d::is_directory(path)) {
    const std::string index = path + "/" + safetensors::kIndexFile;
    const std::string single = path + "/model.safetensors";
    if (d::exists(index)) open_set(index);
    else if (d::exists(single)) open_file(single);
    else
      TORCH_CHECK(false, "fsdp: safetensors: '", path, "' is a directory without ", safetensors::kIndexFile,
                  " or model.safetensors; name the file to load");
  } else if (d::ends_with(path, ".json")) {
    open_set(path);
  } else {
    TORCH_CHECK(d::exists(path), "fsdp: safetensors: '", path, "' does not exist");
    open_file(path);
  }
}

SafetensorsSource::~SafetensorsSource() {
  for (File& f : files_)
    if (f.fd >= 0) ::close(f.fd);
}

void SafetensorsSource::open_file(const std::string& path) {
  File f;
  f.path = path;
  f.header = safetensors::parse_header(path);
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(f.fd >= 0, "fsdp: safetensors: cannot open '", path, "': ", std::strerror(errno));
  files_.push_back(std::move(f));
  const size_t file = files_.size() - 1;
  for (const auto& e : files_[file].header.tensors) {
    // A set's index decides which file holds a name; a lone file holds each once (parse_header).
    if (is_set_) continue;
    names_.push_back(e.name);
    by_name_[e.name] = Tensor{&e, file};
  }
}

void SafetensorsSource::open_set(const std::string& index_path) {
  is_set_ = true;
  const safetensors::Index index = safetensors::parse_index(index_path);
  const std::string dir = safetensors_source_detail::directory_of(index_path);
  std::map<std::string, size_t> file_of_name;
  for (const auto& [name, file] : index.weight_map)
    if (!file_of_name.count(file)) {
      open_file(dir + "/" + file);
      file_of_name[file] = files_.size() - 1;
    }
  // Names in file order: the files as the index first names them, each by offset.
  for (size_t f = 0; f < files_.size(); ++f)
    for (const auto& e : files_[f].header.tensors) {
      const auto it = index.weight_map.find(e.name);
      if (it == index.weight_map.end() || file_of_name.at(it->second) != f) continue;
      names_.push_back(e.name);
      by_name_[e.name] = Tensor{&e, f};
    }
  for (const auto& [name, file] : index.weight_map)
    TORCH_CHECK(by_name_.count(name), "fsdp: safetensors: '", index_path, "': the index puts tensor '", name,
                "' in '", file, "', whose header has no such tensor; the index and its files do not belong together");
}

const SafetensorsSource::Tensor* SafetensorsSource::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &it->second;
}

std::string SafetensorsSource::where(const Tensor& t) const {
  return is_set_ ? "'" + path_ + "' (file '" + files_[t.file].path + "')" : "'" + path_ + "'";
}

void SafetensorsSource::pread_all(const Tensor& t, char* dst, int64_t nbytes, int64_t offset) const {
  const File& f = files_[t.file];
  int64_t done = 0;
  while (done < nbytes) {
    const ssize_t n = ::pread(f.fd, dst + done, static_cast<size_t>(nbytes - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "fsdp: safetensors: reading tensor '", t.entry->name, "' of '", f.path, "' failed: ",
                std::strerror(errno));
    TORCH_CHECK(n > 0, "fsdp: safetensors: '", f.path, "' ends at byte ", offset + done, ", inside tensor '",
                t.entry->name, "' (the file shrank after its header was read)");
    done += n;
  }
}

int64_t SafetensorsSource::read_range(const Tensor& t, int64_t begin, int64_t end, const at::Tensor& dest) const {
  const at::ScalarType dtype = *scalar_type_of(t.entry->dtype);
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t numel = end - begin;
  TORCH_INTERNAL_ASSERT(dest.is_contiguous() && dest.numel() == numel, "read_range of '", t.entry->name, "'");
  const int64_t offset = t.entry->begin + begin * esize;
  if (numel == 0) return 0;
  if (dest.scalar_type() == dtype && dest.device().is_cpu()) {
    pread_all(t, static_cast<char*>(dest.data_ptr()), numel * esize, offset);
    return numel * esize;
  }
  const int64_t chunk = std::max<int64_t>(1, safetensors_source_detail::kStagingBytes / esize);
  const at::Tensor staging =
      at::empty({std::min(numel, chunk) * esize}, at::TensorOptions().dtype(at::kByte).pinned_memory(dest.is_cuda()));
  const at::Tensor flat = dest.view({-1});
  for (int64_t first = 0; first < numel; first += chunk) {
    const int64_t n = std::min(chunk, numel - first);
    pread_all(t, static_cast<char*>(staging.data_ptr()), n * esize, offset + first * esize);
    flat.narrow(0, first, n).copy_(staging.narrow(0, 0, n * esize).view(dtype));
  }
  return numel * esize;
}

at::Tensor SafetensorsSource::read_whole(const Tensor& t) const {
  const at::ScalarType dtype = *scalar_type_of(t.entry->dtype);
  at::Tensor out = at::empty(t.entry->shape, at::TensorOptions().dtype(dtype));
  if (out.numel() > 0)
    pread_all(t, static_cast<char*>(out.data_ptr()), t.entry->end - t.entry->begin, t.entry->begin);
  return out;
}

}  // namespace fsdp::state
