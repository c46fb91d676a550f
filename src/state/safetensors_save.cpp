// save_safetensors (include/fsdp/state/safetensors.h).
//
// [Note: saving safetensors]
// A file's header comes first and holds every tensor's offsets, so the plan is made before
// any value is gathered: the tensors in the order they will be gathered (unit by unit, then
// parameters outside units, then buffers), their names, shapes and stored dtypes, split into
// files. Rank 0 then writes each value as soon as it has it, through the checkpoints' file
// writer (RankFileWriter::write_streamed: converted to the stored dtype and copied to the host
// a chunk at a time), so nothing is held beyond one gathered unit and one chunk. Each file is
// written under a temporary name, made durable, and renamed into place; a sharded set's index
// goes last, so a reader that finds the index finds every file it names.
#include "fsdp/state/safetensors.h"

#include <filesystem>
#include <memory>
#include <unordered_map>

#include <torch/torch.h>

#include "checkpoint_format.h"
#include "comm/object_collectives.h"
#include "core/state_view.h"
#include "error_message.h"
#include "fsdp/comm/call_label.h"
#include "safetensors_format.h"
#include "safetensors_source.h"

namespace fsdp {

namespace safetensors_save_detail {

namespace fs = std::filesystem;
namespace st = state::safetensors;

constexpr int64_t kChunkBytes = int64_t(16) << 20;  // host bytes one conversion step holds

// One tensor of the output, in writing order.
struct SaveItem {
  st::TensorSpec spec;
  at::ScalarType stored = at::kFloat;
  int unit = -1;        // its unit's gathered buffer holds it (entry `entry`), or
  size_t entry = 0;
  at::Tensor value;     // its value, when unit == -1
};

struct FilePart {
  std::string name;
  size_t first = 0, last = 0;  // items [first, last)
};

at::ScalarType stored_dtype(const std::string& name, const at::Tensor& v, const SafetensorsSaveOptions& o) {
  const at::ScalarType t = o.dtype() && at::isFloatingType(v.scalar_type()) ? *o.dtype() : v.scalar_type();
  TORCH_CHECK(state::safetensors_dtype_of(t), "fsdp: save_safetensors: '", name, "' is ", t,
              ", which the safetensors format cannot store");
  return t;
}

SaveItem item_of(const std::string& name, const at::Tensor& v, const SafetensorsSaveOptions& o) {
  SaveItem it;
  it.stored = stored_dtype(name, v, o);
  it.spec = st::TensorSpec{name, *state::safetensors_dtype_of(it.stored), v.sizes().vec()};
  return it;
}

// Sharded model: unit by unit (a tied parameter once, under its first name), then parameters
// outside units, then buffers.
std::vector<SaveItem> items_of(core::detail::StateView& view, const SafetensorsSaveOptions& o) {
  const std::vector<core::detail::LocalPiece> pieces = view.local_pieces("save_safetensors");
  std::unordered_map<const c10::TensorImpl*, const core::detail::LocalPiece*> piece_of;
  for (const auto& p : pieces) piece_of[p.param.unsafeGetTensorImpl()] = &p;
  std::vector<SaveItem> items;
  for (size_t u = 0; u < view.num_units(); ++u) {
    const auto& entries = view.entries(u);
    for (size_t i = 0; i < entries.size(); ++i) {
      const core::detail::LocalPiece& p = *piece_of.at(entries[i].param.unsafeGetTensorImpl());
      SaveItem it = item_of(p.name, p.param, o);
      it.spec.shape = p.shape;
      it.unit = static_cast<int>(u);
      it.entry = i;
      items.push_back(std::move(it));
    }
  }
  for (const auto& p : pieces)
    if (p.unit < 0) {
      items.push_back(item_of(p.name, p.param, o));
      items.back().value = p.param.detach();
    }
  for (const auto& b : view.module().named_buffers()) {
    items.push_back(item_of(b.key(), b.value(), o));
    items.back().value = b.value().detach();
  }
  return items;
}

// Unsharded module: parameters (a tied one once), then buffers.
std::vector<SaveItem> items_of(torch::nn::Module& m, const SafetensorsSaveOptions& o) {
  std::vector<SaveItem> items;
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  for (const auto& p : m.named_parameters())
    if (seen.emplace(p.value().unsafeGetTensorImpl(), true).second) {
      items.push_back(item_of(p.key(), p.value(), o));
      items.back().value = p.value().detach();
    }
  for (const auto& b : m.named_buffers()) {
    items.push_back(item_of(b.key(), b.value(), o));
    items.back().value = b.value().detach();
  }
  return items;
}

int64_t nbytes_of(const SaveItem& it) { return st::tensor_nbytes(it.spec.dtype, it.spec.shape); }

std::string part_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

// One file, or consecutive runs of at most max_shard_bytes (a bigger tensor alone); a set
// that fits in one file is one file without an index, as transformers saves it.
std::vector<FilePart> plan_files(const std::vector<SaveItem>& items, int64_t max_shard_bytes) {
  std::vector<FilePart> parts;
  int64_t in_part = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t n = nbytes_of(items[i]);
    if (parts.empty() || (max_shard_bytes > 0 && in_part > 0 && in_part + n > max_shard_bytes)) {
      parts.push_back(FilePart{"", i, i});
      in_part = 0;
    }
    parts.back().last = i + 1;
    in_part += n;
  }
  if (parts.empty()) parts.push_back(FilePart{});
  for (size_t i = 0; i < parts.size(); ++i)
    parts[i].name = parts.size() > 1 ? part_name(i, parts.size()) : "model.safetensors";
  return parts;
}

// `v`'s elements in the stored dtype, handed to `sink` a chunk at a time.
void stream_value(const at::Tensor& v, at::ScalarType stored, const state::format::RankFileWriter::Sink& sink) {
  const at::Tensor flat = v.reshape({-1});
  const int64_t esize = static_cast<int64_t>(c10::elementSize(stored));
  if (flat.device().is_cpu() && flat.scalar_type() == stored && flat.is_contiguous()) {
    sink(static_cast<const char*>(flat.data_ptr()), static_cast<size_t>(flat.numel() * esize));
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / esize);
  for (int64_t first = 0; first < flat.numel(); first += chunk) {
    const at::Tensor host =
        flat.narrow(0, first, std::min(chunk, flat.numel() - first)).to(at::kCPU, stored).contiguous();
    sink(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(host.numel() * esize));
  }
}

// Rank 0's side of a save: the files, written in item order as values arrive.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string dir, std::vector<SaveItem> items, const SafetensorsSaveOptions& o)
      : dir_(std::move(dir)), items_(std::move(items)), parts_(plan_files(items_, o.max_shard_bytes())),
        metadata_(o.metadata()) {
    fs::create_directories(dir_);
    // An index from an earlier save would name files this one replaces one by one: gone
    // first, so that no reader meets a set mixed from two saves.
    if (fs::remove(dir_ + "/" + st::kIndexFile)) state::format::fsync_dir(dir_);
  }

  const std::vector<SaveItem>& items() const { return items_; }

  // Item `i`'s value (items are written in order).
  void write(size_t i, const at::Tensor& v) {
    if (!file_) open(part_of(i));
    const SaveItem& it = items_[i];
    TORCH_INTERNAL_ASSERT(v.sizes() == c10::IntArrayRef(it.spec.shape), "save_safetensors: ", it.spec.name);
    file_->write_streamed(it.spec.name, "safetensors", it.stored, 0, v.numel(),
                          [&](const auto& sink) { stream_value(v, it.stored, sink); });
    if (i + 1 == parts_[part_].last) close();
  }

  // Files without items (a model without tensors) and, for a set, the index.
  void finish() {
    if (items_.empty()) {
      open(0);
      close();
    }
    if (parts_.size() > 1) write_index();
  }

 private:
  std::string dir_;
  std::vector<SaveItem> items_;
  std::vector<FilePart> parts_;
  std::map<std::string, std::string> metadata_;
  std::unique_ptr<state::format::RankFileWriter> file_;
  size_t part_ = 0;

  size_t part_of(size_t i) const {
    for (size_t p = 0; p < parts_.size(); ++p)
      if (i < parts_[p].last) return p;
    TORCH_INTERNAL_ASSERT(false, "save_safetensors: item ", i, " is in no file");
  }

  void open(size_t p) {
    part_ = p;
    std::vector<st::TensorSpec> specs;
    for (size_t i = parts_[p].first; i < parts_[p].last; ++i) specs.push_back(items_[i].spec);
    file_ = std::make_unique<state::format::RankFileWriter>(dir_, parts_[p].name + ".tmp");
    file_->write_preamble(st::serialize_header(specs, metadata_));
  }

  void close() {
    file_->finish();
    file_.reset();
    fs::rename(dir_ + "/" + parts_[part_].name + ".tmp", dir_ + "/" + parts_[part_].name);
    state::format::fsync_dir(dir_);
  }

  void write_index() {
    std::map<std::string, std::string> weight_map;
    int64_t total = 0;
    for (const FilePart& p : parts_)
      for (size_t i = p.first; i < p.last; ++i) {
        weight_map[items_[i].spec.name] = p.name;
        total += nbytes_of(items_[i]);
      }
    const std::string text = st::serialize_index(weight_map, total);
    state::format::RankFileWriter index(dir_, std::string(st::kIndexFile) + ".tmp");
    index.write_preamble(text);
    index.finish();
    fs::rename(dir_ + "/" + st::kIndexFile + ".tmp", dir_ + "/" + st::kIndexFile);
    state::format::fsync_dir(dir_);
  }
};

}  // namespace safetensors_save_detail

void save_safetensors(FullyShardedBase& model, const std::string& dir, const SafetensorsSaveOptions& options) {
  namespace d = safetensors_save_detail;
  comm::LabelScope label_scope({comm::Phase::kStateDict, "save_safetensors"});
  core::detail::StateView view(model);
  const comm::ProcessGroup& pg = view.group();
  const bool writer = pg.rank() == 0;
  torch::NoGradGuard no_grad;
  // Every rank plans (the same plan: the same model), so that a refused dtype fails all
  // ranks alike before the first collective; rank 0 alone writes.
  const std::vector<d::SaveItem> items = d::items_of(view, options);
  std::unique_ptr<d::SafetensorsWriter> out;
  std::string error;
  if (writer) error = state::failure_of([&] { out = std::make_unique<d::SafetensorsWriter>(dir, items, options); });
  // A failed write stops rank 0's writing, not the gathers the other ranks take part in.
  auto write = [&](size_t i, const at::Tensor& v) {
    if (writer && error.empty()) error = state::failure_of([&] { out->write(i, v); });
  };
  size_t next = 0;
  for (size_t u = 0; u < view.num_units(); ++u) {
    const at::Tensor full = view.gather_full(u);
    for (; next < items.size() && items[next].unit == static_cast<int>(u); ++next)
      write(next, view.view_of(u, full, items[next].entry));
  }
  for (; next < items.size(); ++next) write(next, items[next].value);
  if (writer && error.empty()) error = state::failure_of([&] { out->finish(); });
  const std::string agreed = comm::broadcast_object(pg, error, 0);
  TORCH_CHECK(agreed.empty(), "fsdp: save_safetensors (rank ", pg.rank(), "): rank 0 could not write '", dir,
              "': ", agreed);
}

void save_safetensors(torch::nn::Module& model, const std::string& dir, const SafetensorsSaveOptions& options) {
  namespace d = safetensors_save_detail;
  torch::NoGradGuard no_grad;
  d::SafetensorsWriter out(dir, d::items_of(model, options), options);
  for (size_t i = 0; i < out.items().size(); ++i) out.write(i, out.items()[i].value);
  out.finish();
}

}  // namespace fsdp
