#include "fsdp/state/checkpoint_tools.h"

#include <fcntl.h>
#include <unistd.h>

#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <sstream>

#include <torch/torch.h>

#include "checkpoint_format.h"
#include "checkpoint_zip.h"
#include "checkpoint_testing.h"
#include "memory/tensor_on_memory.h"
#include "unpickled_dict.h"

namespace fsdp {

namespace fs = std::filesystem;
using json = nlohmann::json;
namespace fmt = state::format;

namespace {

std::atomic<bool> zip64_always{false};  // set_consolidate_zip64_always (checkpoint_testing.h)

json read_metadata(const std::string& dir) {
  const std::string path = dir + "/" + fmt::kMetadataFile;
  TORCH_CHECK(fs::exists(path), "fsdp-ckpt: '", path, "' does not exist (not a checkpoint, or an incomplete save)");
  json meta = json::parse(fmt::read_text_file(path));
  TORCH_CHECK(meta.value("format", "") == fmt::kFormatName, "fsdp-ckpt: '", path, "' is not an fsdp-cpp checkpoint");
  return meta;
}

// Whole-file CRC-32, streamed in 4 MiB blocks.
bool file_crc(const std::string& path, uint32_t* crc) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::vector<char> buf(4 << 20);
  uint32_t c = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      return false;
    }
    if (n == 0) break;
    c = fmt::crc32_of(buf.data(), static_cast<size_t>(n), c);
  }
  ::close(fd);
  *crc = c;
  return true;
}

}  // namespace

std::string inspect_checkpoint(const std::string& dir, bool verify, bool* ok) {
  const json meta = read_metadata(dir);
  bool all_ok = true;
  std::ostringstream os;
  os << "checkpoint " << dir << "\n"
     << "  format " << meta["format"].get<std::string>() << " v" << meta["version"].get<int>() << ", world size "
     << meta["world_size"].get<int>() << ", strategy " << meta["strategy"].get<std::string>() << ", optimizer "
     << (meta["optimizer"].is_null() ? std::string("none") : meta["optimizer"].get<std::string>()) << "\n";
  for (const auto& kv : meta["extra"].items())
    os << "  extra " << kv.key() << " = " << kv.value().get<std::string>() << "\n";
  std::map<std::string, int64_t> state_bytes;  // item -> optimizer state bytes
  for (const auto& r : meta["records"]) {
    const std::string kind = r["kind"];
    if (kind == fmt::kParam || kind == fmt::kBuffer || kind == fmt::kExtra) continue;
    state_bytes[r["item"]] += (r["end"].get<int64_t>() - r["begin"].get<int64_t>()) *
                              static_cast<int64_t>(c10::elementSize(fmt::parse_dtype(r["dtype"])));
  }
  int64_t total_numel = 0;
  os << "  items:\n";
  for (const auto& it : meta["items"].items()) {
    const auto shape = it.value()["shape"].get<std::vector<int64_t>>();
    int64_t numel = 1;
    for (auto d : shape) numel *= d;
    if (it.value()["kind"] == fmt::kParam) total_numel += numel;
    const std::string dtype = it.value()["dtype"];
    os << "    " << it.value()["kind"].get<std::string>() << " " << it.key() << " " << c10::IntArrayRef(shape) << " "
       << dtype << " " << numel * static_cast<int64_t>(c10::elementSize(fmt::parse_dtype(dtype))) << " B";
    if (state_bytes.count(it.key())) os << " (+" << state_bytes[it.key()] << " B optimizer state)";
    os << "\n";
  }
  os << "  parameters: " << total_numel << " elements\n  files:\n";
  for (const auto& f : meta["files"]) {
    const std::string name = f["name"];
    const std::string path = dir + "/" + name;
    const int64_t bytes = f["bytes"];
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    std::string status;
    if (ec) status = "MISSING";
    else if (static_cast<int64_t>(size) != bytes) status = "TRUNCATED (" + std::to_string(size) + " B on disk)";
    else if (!verify) status = "size ok (checksum not verified)";
    else {
      uint32_t crc = 0;
      status = file_crc(path, &crc) && crc == f["crc32"].get<uint32_t>() ? "checksum ok" : "CHECKSUM MISMATCH";
    }
    if (status == "MISSING" || status.rfind("TRUNCATED", 0) == 0 || status == "CHECKSUM MISMATCH") all_ok = false;
    os << "    " << name << " " << bytes << " B " << status << "\n";
  }
  if (ok) *ok = all_ok;
  return os.str();
}

namespace {

// The phases of consolidate_checkpoint, in order.

// A parameter or buffer of the consolidated file, whole.
struct Item {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

int64_t item_numel(const Item& item) {
  int64_t numel = 1;
  for (auto d : item.shape) numel *= d;
  return numel;
}

// The checkpoint's records of model items (parameters and buffers), by item.
using RecordsByItem = std::map<std::string, std::vector<fmt::Record>>;

RecordsByItem model_records(const json& meta) {
  RecordsByItem records;
  for (const auto& rj : meta["records"]) {
    fmt::Record r = rj.get<fmt::Record>();
    if (r.kind == fmt::kParam || r.kind == fmt::kBuffer) records[r.item].push_back(std::move(r));
  }
  return records;
}

// 1. The pickle of {name: tensor} with storage placeholders: tensors whose storages have
// the right size but no memory, so pickling allocates nothing. `items` gets the items in
// the order of the pickle's storages.
std::vector<char> placeholder_pickle(const json& meta, const std::string& dir, std::vector<Item>& items) {
  std::vector<std::string> names = meta["parameter_order"].get<std::vector<std::string>>();
  for (const auto& it : meta["items"].items())
    if (it.value()["kind"] == fmt::kBuffer) names.push_back(it.key());
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& name : names) {
    const auto& info = meta["items"][name];
    Item item{name, info["shape"].get<std::vector<int64_t>>(), fmt::parse_dtype(info["dtype"])};
    dict.insert(name, memory::tensor_on_memory(c10::DataPtr(nullptr, c10::Device(c10::kCPU)), item.shape,
                                               at::TensorOptions().dtype(item.dtype)));
    items.push_back(std::move(item));
  }
  // Tied parameters: every alias names the same tensor, so the pickler writes
  // one storage record that both keys share (as torch.save of a tied model does).
  const json aliases = meta.value("aliases", json::object());
  for (const auto& a : aliases.items()) {
    const std::string canonical = a.value().get<std::string>();
    TORCH_CHECK(dict.contains(canonical), "fsdp-ckpt: checkpoint '", dir, "': alias '", a.key(),
                "' names '", canonical, "', which the checkpoint does not hold");
    dict.insert(a.key(), dict.at(canonical));
  }
  state::detail::UntaggedPickle p = state::detail::pickle_untagged(c10::IValue(dict));
  TORCH_INTERNAL_ASSERT(p.tensors.size() == items.size());
  return std::move(p.bytes);
}

// The buffer records stream through: 1 MiB, or the largest item if smaller; through the
// CPU allocator, so allocator-level accounting sees it.
at::Tensor stream_buffer(const std::vector<Item>& items) {
  size_t largest = 1;
  for (const auto& item : items) {
    size_t nbytes = c10::elementSize(item.dtype);
    for (auto d : item.shape) nbytes *= static_cast<size_t>(d);
    largest = std::max(largest, nbytes);
  }
  const size_t buf_bytes = std::min<size_t>(largest, 1 << 20);
  return at::empty({static_cast<int64_t>(buf_bytes)}, at::kByte);
}

// An item's CRC-32, combined from its records' CRCs, once the records (sorted here) are
// checked to tile [0, numel) in order: the archive is written front to back.
uint32_t item_crc(const std::string& dir, const Item& item, std::vector<fmt::Record>& recs) {
  const int64_t numel = item_numel(item);
  const size_t esize = c10::elementSize(item.dtype);
  std::sort(recs.begin(), recs.end(), [](const fmt::Record& x, const fmt::Record& y) { return x.begin < y.begin; });
  int64_t covered = 0;
  uint32_t crc = 0;
  for (const auto& r : recs) {
    TORCH_CHECK(fmt::parse_dtype(r.dtype) == item.dtype, "fsdp-ckpt: checkpoint '", dir, "': record of '",
                item.name, "' in ", r.file, " is ", r.dtype, ", the item is ", fmt::dtype_name(item.dtype));
    if (r.begin == r.end) continue;
    TORCH_CHECK(r.begin == covered, "fsdp-ckpt: checkpoint '", dir, "': the records of '", item.name,
                "' do not tile it: elements [", covered, ", ", r.begin, ") are ",
                r.begin > covered ? "missing" : "stored twice", " (", r.file, ")");
    crc = static_cast<uint32_t>(
        ::crc32_combine(crc, r.crc32, static_cast<z_off_t>((r.end - r.begin) * static_cast<int64_t>(esize))));
    covered = r.end;
  }
  TORCH_CHECK(covered == numel, "fsdp-ckpt: checkpoint '", dir, "' covers ", covered, " of ", numel,
              " elements of '", item.name, "'");
  return crc;
}

// 2. The zip archive (see [Note: why not PyTorchStreamWriter]): data.pkl,
// then data/<i> per item, streamed from its checkpoint records through one
// 1 MiB buffer: each chunk is read, checksummed against its record and
// written while still in the CPU cache. An item's CRC-32 (needed up front, in
// its local header) is combined from its records' CRCs, which the reads
// verify, so no byte is checksummed twice.
void write_archive(const std::string& dir, const std::string& path, const std::vector<char>& pickle,
                   const std::vector<Item>& items, RecordsByItem& records) {
  fmt::StoredZipWriter writer(path, "archive");  // torch.save's directory name
  writer.force_zip64(zip64_always.load(std::memory_order_relaxed));
  writer.write_record("data.pkl", pickle.data(), pickle.size());
  fmt::RankFileReader reader(dir);
  auto buf_t = stream_buffer(items);
  char* buf = reinterpret_cast<char*>(buf_t.data_ptr<uint8_t>());
  const size_t buf_bytes = static_cast<size_t>(buf_t.numel());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    auto& recs = records[item.name];
    const uint32_t crc = item_crc(dir, item, recs);
    writer.begin_record("data/" + std::to_string(i),
                        static_cast<uint64_t>(item_numel(item)) * c10::elementSize(item.dtype), crc);
    for (const auto& r : recs)
      if (r.begin != r.end) reader.stream(r, buf, buf_bytes, [&](const char* p, size_t n) { writer.append(p, n); });
    writer.end_record();
  }
  writer.finish();
}

}  // namespace

void consolidate_checkpoint(const std::string& dir, const std::string& out) {
  const json meta = read_metadata(dir);
  RecordsByItem records = model_records(meta);
  std::vector<Item> items;
  const std::vector<char> pickle = placeholder_pickle(meta, dir, items);
  const std::string tmp = out + ".tmp";
  try {
    write_archive(dir, tmp, pickle, items, records);
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);  // a failed consolidate leaves nothing behind
    throw;
  }
  fs::rename(tmp, out);
  fmt::fsync_dir(fs::absolute(out).parent_path().string());
}

}  // namespace fsdp

namespace fsdp::state::detail {
void set_consolidate_zip64_always(bool on) { zip64_always.store(on, std::memory_order_relaxed); }
}  // namespace fsdp::state::detail
