#include "mapped_state_dict.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <set>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <torch/torch.h>

#include "fsdp/state/rank0_load.h"
#include "unpickled_dict.h"

namespace fsdp {
namespace state::detail {
namespace {

// One mmap of a whole file, unmapped when the last tensor viewing it is freed:
// every storage's DataPtr holds a shared_ptr to it as its context.
struct FileMapping {
  char* base = nullptr;
  size_t size = 0;
  ~FileMapping() {
    if (base != nullptr) munmap(base, size);
  }
};

void delete_mapping_ref(void* ctx) { delete static_cast<std::shared_ptr<FileMapping>*>(ctx); }

std::string errno_text() { return std::strerror(errno); }

}  // namespace

void release_mapped_pages(const std::vector<at::Tensor>& tensors) {
  std::set<const FileMapping*> done;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const c10::DataPtr& dp = t.storage().data_ptr();
    if (dp.get_deleter() != &delete_mapping_ref) continue;
    const FileMapping* m = static_cast<std::shared_ptr<FileMapping>*>(dp.get_context())->get();
    // The whole mapping, not the tensor's pages: a page fault maps the
    // neighbouring cached pages too (the kernel's fault-around, 64 KiB), so
    // pages of tensors released before come back with the next tensor's.
    if (done.insert(m).second) madvise(m->base, m->size, MADV_DONTNEED);
  }
}

}  // namespace state::detail

StateDict map_full_state_dict(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "fsdp: map_full_state_dict: cannot open '", path, "': ", state::detail::errno_text());
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const std::string err = state::detail::errno_text();
    close(fd);
    TORCH_CHECK(false, "fsdp: map_full_state_dict: cannot stat '", path, "': ", err);
  }
  auto mapping = std::make_shared<state::detail::FileMapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  // Private and writable: a write into a tensor copies its page instead of
  // crashing (or changing the file).
  void* base = st.st_size > 0 ? mmap(nullptr, mapping->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0) : MAP_FAILED;
  const std::string map_err = state::detail::errno_text();
  close(fd);
  TORCH_CHECK(base != MAP_FAILED, "fsdp: map_full_state_dict: cannot map '", path, "' (", st.st_size,
              " bytes): ", map_err);
  mapping->base = static_cast<char*>(base);

  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fsdp: map_full_state_dict: '", path, "' is not a zip-format state dict (",
                e.what_without_backtrace(), "). Save it with torch.save(dict(model.state_dict()), path) from "
                "torch >= 1.6 (without _use_new_zipfile_serialization=False), fsdp::save_full_state_dict or "
                "fsdp-ckpt consolidate");
  }
  TORCH_CHECK(zip->hasRecord("data.pkl"), "fsdp: map_full_state_dict: '", path,
              "' has no data.pkl record: not a torch.save file (a TorchScript module? save its state_dict)");
  at::DataPtr pickle;
  size_t pickle_size = 0;
  std::tie(pickle, pickle_size) = zip->getRecord("data.pkl");
  size_t pickle_read = 0;
  auto reader = [&](char* buffer, size_t len) -> size_t {
    len = std::min(pickle_size - pickle_read, len);
    std::memcpy(buffer, static_cast<const char*>(pickle.get()) + pickle_read, len);
    pickle_read += len;
    return len;
  };
  // Each storage record becomes a view of the mapping instead of a copy.
  auto read_record = [&](const std::string& key) -> at::DataPtr {
    const std::string name = "data/" + key;
    TORCH_CHECK(zip->hasRecord(name), "fsdp: map_full_state_dict: '", path, "' lacks the record '", name, "'");
    const size_t offset = zip->getRecordOffset(name);
    TORCH_CHECK(offset <= mapping->size, "fsdp: map_full_state_dict: record '", name, "' of '", path,
                "' starts past the end of the file");
    return at::DataPtr(mapping->base + offset, new std::shared_ptr<state::detail::FileMapping>(mapping),
                       &state::detail::delete_mapping_ref, at::kCPU);
  };
  StateDict out = state::detail::unpickled_state_dict("map_full_state_dict", path, [&] {
    torch::jit::Unpickler unpickler(reader, nullptr, nullptr, read_record, c10::nullopt);
    unpickler.set_version(zip->version());
    return unpickler.parse_ivalue();
  });
  for (const auto& kv : out) {
    const at::Tensor& t = kv.value();
    const std::string& key = kv.key();
    // A truncated file would fault (SIGBUS) on first touch: check the extent now.
    if (t.has_storage() && t.storage().nbytes() > 0) {
      const size_t begin = static_cast<const char*>(t.storage().data()) - mapping->base;
      TORCH_CHECK(begin + t.storage().nbytes() <= mapping->size, "fsdp: map_full_state_dict: '", key, "' in '",
                  path, "' needs bytes [", begin, ", ", begin + t.storage().nbytes(), ") but the file has ",
                  mapping->size, " (truncated?)");
    }
  }
  return out;
}

}  // namespace fsdp
