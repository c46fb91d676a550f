#pragma once
// Internal to src/state: a PyTorch Distributed Checkpoint directory opened for reading
// ([Note: loading DCP] in include/fsdp/state/dcp.h): its .metadata parsed, its .distcp files
// opened; each saved chunk is a torch.save archive at an offset in one of them.

#include <cstdint>
#include <map>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "dcp_metadata.h"

namespace fsdp::state {

/// The torch dtype DCP names `name` ("float32", "bfloat16", ...); throws for one it lacks.
at::ScalarType dcp_scalar_type(const std::string& name);
/// The name DCP writes for `t`.
std::string dcp_dtype_name(at::ScalarType t);

class DcpSource {
 public:
  /// Reads `dir`/.metadata; throws naming the directory when it is none or the file is bad.
  explicit DcpSource(std::string dir);
  ~DcpSource();
  DcpSource(const DcpSource&) = delete;
  DcpSource& operator=(const DcpSource&) = delete;

  const dcp::Metadata& metadata() const { return metadata_; }
  const std::string& dir() const { return dir_; }

  /// Elements [begin, end) of the flattened tensor `e`, from every chunk that holds some of
  /// them, converted into `dest` (contiguous, end - begin elements, any dtype and device).
  /// Returns the bytes of the chunks read. Throws when the chunks leave a gap.
  int64_t read_range(const dcp::Entry& e, int64_t begin, int64_t end, const at::Tensor& dest);
  /// A non-tensor value (a torch.save'd Python value: a float, a tuple, a list of strings).
  c10::IValue read_value(const dcp::Entry& e);

 private:
  std::string dir_;
  dcp::Metadata metadata_;
  std::map<std::string, int> fds_;

  std::vector<char> read_bytes(const std::string& fqn, const dcp::StorageInfo& s);
  at::Tensor read_chunk(const dcp::Entry& e, size_t i);
};

}  // namespace fsdp::state
