#include "dcp_source.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include "dcp_boxes.h"

namespace fsdp::state {

namespace dcp_source_detail {

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf},  {"bfloat16", at::kBFloat16},
    {"int64", at::kLong},    {"int32", at::kInt},      {"int16", at::kShort},   {"int8", at::kChar},
    {"uint8", at::kByte},    {"bool", at::kBool},      {"complex64", at::kComplexFloat},
    {"complex128", at::kComplexDouble},
};

// Whether the sorted, merged intervals cover [begin, end).
bool covers(std::vector<std::pair<int64_t, int64_t>> got, int64_t begin, int64_t end) {
  std::sort(got.begin(), got.end());
  int64_t at = begin;
  for (const auto& [lo, hi] : got) {
    if (lo > at) return false;
    at = std::max(at, hi);
  }
  return at >= end;
}

}  // namespace dcp_source_detail

at::ScalarType dcp_scalar_type(const std::string& name) {
  for (const auto& d : dcp_source_detail::kDtypes)
    if (name == d.name) return d.type;
  TORCH_CHECK(false, "fsdp: dcp: dtype torch.", name, " is not one fsdp-cpp loads");
}

std::string dcp_dtype_name(at::ScalarType t) {
  for (const auto& d : dcp_source_detail::kDtypes)
    if (t == d.type) return d.name;
  TORCH_CHECK(false, "fsdp: dcp: dtype ", t, " has no DCP name here");
}

DcpSource::DcpSource(std::string dir) : dir_(std::move(dir)) {
  const std::string path = dir_ + "/.metadata";
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "fsdp: dcp: '", dir_, "' holds no .metadata: not a checkpoint torch.distributed.checkpoint "
              "wrote (dcp.save with a FileSystemWriter), or not complete");
  std::stringstream text;
  text << in.rdbuf();
  metadata_ = dcp::parse_metadata(text.str(), path);
}

DcpSource::~DcpSource() {
  for (const auto& [name, fd] : fds_) ::close(fd);
}

std::vector<char> DcpSource::read_bytes(const std::string& fqn, const dcp::StorageInfo& s) {
  TORCH_CHECK(!s.transformed, "fsdp: dcp: '", dir_, "': '", fqn, "' is stored through a transform (compression or "
              "another stream transform), which fsdp-cpp does not read; save without one");
  auto it = fds_.find(s.relative_path);
  if (it == fds_.end()) {
    const std::string path = dir_ + "/" + s.relative_path;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK(fd >= 0, "fsdp: dcp: cannot open '", path, "' (it holds '", fqn, "'): ", std::strerror(errno));
    it = fds_.emplace(s.relative_path, fd).first;
  }
  std::vector<char> bytes(static_cast<size_t>(s.length));
  for (int64_t done = 0; done < s.length;) {
    const ssize_t n = ::pread(it->second, bytes.data() + done, static_cast<size_t>(s.length - done), s.offset + done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "fsdp: dcp: '", dir_, "/", s.relative_path, "' ends before the bytes of '", fqn, "' (",
                s.length, " bytes at ", s.offset, ")", n < 0 ? std::string(": ") + std::strerror(errno) : "");
    done += n;
  }
  return bytes;
}

at::Tensor DcpSource::read_chunk(const dcp::Entry& e, size_t i) {
  const c10::IValue v = torch::pickle_load(read_bytes(e.fqn, e.storage[i]));
  TORCH_CHECK(v.isTensor(), "fsdp: dcp: '", dir_, "': chunk ", i, " of '", e.fqn, "' holds a ", v.tagKind(),
              ", not a tensor");
  const at::Tensor t = v.toTensor();
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(e.chunks[i].sizes), "fsdp: dcp: '", dir_, "': chunk ", i, " of '", e.fqn,
              "' has shape ", t.sizes(), ", its metadata says ", c10::IntArrayRef(e.chunks[i].sizes));
  return t.contiguous().view({-1});
}

int64_t DcpSource::read_range(const dcp::Entry& e, int64_t begin, int64_t end, const at::Tensor& dest) {
  int64_t bytes = 0;
  std::vector<std::pair<int64_t, int64_t>> got;
  for (size_t i = 0; i < e.chunks.size(); ++i) {
    const std::vector<dcp::Run> runs = dcp::runs_of(e.size, e.chunks[i]);
    at::Tensor chunk;
    for (const dcp::Run& r : runs) {
      const int64_t lo = std::max(begin, r.flat), hi = std::min(end, r.flat + r.length);
      if (lo >= hi) continue;
      if (!chunk.defined()) {
        chunk = read_chunk(e, i);
        bytes += e.storage[i].length;
      }
      dest.narrow(0, lo - begin, hi - lo).copy_(chunk.narrow(0, r.local + lo - r.flat, hi - lo));
      got.emplace_back(lo, hi);
    }
  }
  TORCH_CHECK(begin >= end || dcp_source_detail::covers(got, begin, end), "fsdp: dcp: '", dir_, "': the chunks of '",
              e.fqn, "' leave some of elements [", begin, ", ", end, ") unsaved");
  return bytes;
}

c10::IValue DcpSource::read_value(const dcp::Entry& e) {
  TORCH_CHECK(!e.is_tensor && e.storage.size() == 1, "fsdp: dcp: '", e.fqn, "' is not a saved value");
  return torch::pickle_load(read_bytes(e.fqn, e.storage[0]));
}

}  // namespace fsdp::state
