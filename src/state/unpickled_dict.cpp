#include "unpickled_dict.h"

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

namespace fsdp::state::detail {

StateDict unpickled_state_dict(const char* fn, const std::string& path, const std::function<c10::IValue()>& unpickle) {
  c10::IValue v;
  try {
    v = unpickle();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fsdp: ", fn, ": cannot unpickle '", path, "' (", e.what_without_backtrace(),
                "). Save a plain dict from Python: torch.save(dict(model.state_dict()), path); an OrderedDict "
                "with _metadata is not readable from C++");
  }
  TORCH_CHECK(v.isGenericDict(), "fsdp: ", fn, ": '", path, "' holds a ", v.tagKind(),
              ", not a dict of tensors (save it with torch.save(dict(model.state_dict()), path))");
  StateDict out;
  for (const auto& kv : v.toGenericDict()) {
    TORCH_CHECK(kv.key().isString() && kv.value().isTensor(), "fsdp: ", fn, ": '", path,
                "' has a non-string key or non-tensor value");
    out.insert(kv.key().toStringRef(), kv.value().toTensor());
  }
  return out;
}

UntaggedPickle pickle_untagged(const c10::IValue& value) {
  UntaggedPickle out;
  torch::jit::Pickler pickler([&](const char* b, size_t n) { out.bytes.insert(out.bytes.end(), b, b + n); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  out.tensors = pickler.tensorData();
  return out;
}

std::vector<char> pickle_save_untagged(const c10::IValue& value) {
  const UntaggedPickle pickle = pickle_untagged(value);
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
    out.insert(out.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.bytes.data(), pickle.bytes.size(), pickle.tensors, writer);
  writer.writeEndOfFile();
  return out;
}

}  // namespace fsdp::state::detail
