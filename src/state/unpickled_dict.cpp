#include "unpickled_dict.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

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

}  // namespace fsdp::detail
