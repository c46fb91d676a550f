#include "checkpoint_zip.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

#include "checkpoint_format.h"

namespace fsdp::state::format {

namespace {

constexpr uint64_t kAlignment = 64;          // data alignment torch's reader relies on for mmap
constexpr uint64_t kMax32 = 0xFFFFFFFFull;   // sizes/offsets at or above this go in ZIP64 fields
constexpr uint16_t kVersionNeeded = 20, kVersionNeeded64 = 45;

// Little-endian field appenders.
void u16(std::string& b, uint16_t v) {
  b.push_back(static_cast<char>(v & 0xFF));
  b.push_back(static_cast<char>(v >> 8));
}
void u32(std::string& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void u64(std::string& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

// DOS date 1980-01-01 00:00 (PyTorchStreamWriter's miniz is built without time).
constexpr uint16_t kDosTime = 0, kDosDate = (1 << 5) | 1;

}  // namespace

StoredZipWriter::StoredZipWriter(std::string path, std::string archive_name)
    : path_(std::move(path)), prefix_(std::move(archive_name) + "/") {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "fsdp-ckpt: cannot create '", path_, "': ", std::strerror(errno));
}

StoredZipWriter::~StoredZipWriter() {
  if (fd_ >= 0) ::close(fd_);
}

bool StoredZipWriter::zip64_size(uint64_t size) const { return force_zip64_ || size >= kMax32; }
bool StoredZipWriter::zip64_offset(uint64_t offset) const { return force_zip64_ || offset >= kMax32; }

void StoredZipWriter::put(const void* data, size_t n) {
  write_all(fd_, data, n, "fsdp-ckpt", path_);
  pos_ += n;
  // Start the write-back of every full 8 MiB behind us (asynchronous), so the
  // disk works while the next chunks are read; finish()'s fsync makes it durable.
  constexpr uint64_t kSyncStep = 8 << 20;
  if (pos_ - synced_ >= kSyncStep) {
    ::sync_file_range(fd_, static_cast<off_t>(synced_), static_cast<off_t>(pos_ - synced_), SYNC_FILE_RANGE_WRITE);
    synced_ = pos_;
  }
}

void StoredZipWriter::write_record(const std::string& name, const void* data, uint64_t size) {
  begin_record(name, size, crc32_of(data, size));
  append(data, size);
  end_record();
}

void StoredZipWriter::begin_record(const std::string& name, uint64_t size, uint32_t crc32) {
  TORCH_INTERNAL_ASSERT(!in_record_, "StoredZipWriter: record '", name, "' begun inside another");
  Entry e{prefix_ + name, size, pos_, crc32};
  const bool big = zip64_size(size), far = zip64_offset(pos_);
  // The local ZIP64 extra carries the sizes when they do not fit (and, as
  // PyTorchStreamWriter's miniz writes it, the header offset when that does not).
  std::string z64;
  if (big || far) {
    u16(z64, 0x0001);
    u16(z64, static_cast<uint16_t>((big ? 16 : 0) + (far ? 8 : 0)));
    if (big) {
      u64(z64, size);
      u64(z64, size);
    }
    if (far) u64(z64, pos_);
  }
  // Pad with an "FB" extra field so the data starts on a 64-byte boundary.
  const uint64_t start = pos_ + 30 + e.name.size() + z64.size() + 4;
  const uint64_t pad = (kAlignment - start % kAlignment) % kAlignment;
  std::string h;
  h.reserve(30 + e.name.size() + z64.size() + 4 + pad);
  u32(h, 0x04034b50);
  u16(h, big || far ? kVersionNeeded64 : kVersionNeeded);
  u16(h, 0);  // flags
  u16(h, 0);  // stored
  u16(h, kDosTime);
  u16(h, kDosDate);
  u32(h, crc32);
  u32(h, big ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(size));
  u32(h, big ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(size));
  u16(h, static_cast<uint16_t>(e.name.size()));
  u16(h, static_cast<uint16_t>(z64.size() + 4 + pad));
  h += e.name;
  h += z64;
  h += "FB";
  u16(h, static_cast<uint16_t>(pad));
  h.append(pad, 'Z');
  put(h.data(), h.size());
  TORCH_INTERNAL_ASSERT(pos_ % kAlignment == 0);
  entries_.push_back(std::move(e));
  record_left_ = size;
  in_record_ = true;
}

void StoredZipWriter::append(const void* data, size_t n) {
  TORCH_INTERNAL_ASSERT(in_record_ && n <= record_left_, "StoredZipWriter: more bytes than the record's size");
  put(data, n);
  record_left_ -= n;
}

void StoredZipWriter::end_record() {
  TORCH_INTERNAL_ASSERT(in_record_ && record_left_ == 0, "StoredZipWriter: record '", entries_.back().name,
                        "' ended ", record_left_, " bytes short");
  in_record_ = false;
}

void StoredZipWriter::finish() {
  // torch.save's archive format version (PyTorchStreamWriter's default).
  write_record("version", "3\n", 2);
  const uint64_t cd_offset = pos_;
  std::string cd;
  bool any64 = force_zip64_;
  for (const auto& e : entries_) {
    const bool big = zip64_size(e.size), far = zip64_offset(e.offset);
    any64 = any64 || big || far;
    std::string z64;
    if (big || far) {
      u16(z64, 0x0001);
      u16(z64, static_cast<uint16_t>((big ? 16 : 0) + (far ? 8 : 0)));
      if (big) {
        u64(z64, e.size);
        u64(z64, e.size);
      }
      if (far) u64(z64, e.offset);
    }
    u32(cd, 0x02014b50);
    u16(cd, big || far ? kVersionNeeded64 : kVersionNeeded);  // made by (MS-DOS attributes)
    u16(cd, big || far ? kVersionNeeded64 : kVersionNeeded);  // needed
    u16(cd, 0);
    u16(cd, 0);
    u16(cd, kDosTime);
    u16(cd, kDosDate);
    u32(cd, e.crc32);
    u32(cd, big ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(e.size));
    u32(cd, big ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(e.size));
    u16(cd, static_cast<uint16_t>(e.name.size()));
    u16(cd, static_cast<uint16_t>(z64.size()));
    u16(cd, 0);  // comment
    u16(cd, 0);  // disk
    u16(cd, 0);  // internal attributes
    u32(cd, 0);  // external attributes
    u32(cd, far ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(e.offset));
    cd += e.name;
    cd += z64;
  }
  const uint64_t cd_size = cd.size(), n = entries_.size();
  any64 = any64 || n >= 0xFFFF || cd_offset >= kMax32 || cd_size >= kMax32;
  if (any64) {
    const uint64_t eocd64 = cd_offset + cd_size;
    u32(cd, 0x06064b50);  // ZIP64 end of central directory record
    u64(cd, 44);
    u16(cd, kVersionNeeded64);
    u16(cd, kVersionNeeded64);
    u32(cd, 0);
    u32(cd, 0);
    u64(cd, n);
    u64(cd, n);
    u64(cd, cd_size);
    u64(cd, cd_offset);
    u32(cd, 0x07064b50);  // its locator
    u32(cd, 0);
    u64(cd, eocd64);
    u32(cd, 1);
  }
  u32(cd, 0x06054b50);
  u16(cd, 0);
  u16(cd, 0);
  u16(cd, any64 ? 0xFFFF : static_cast<uint16_t>(n));
  u16(cd, any64 ? 0xFFFF : static_cast<uint16_t>(n));
  u32(cd, any64 ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(cd_size));
  u32(cd, any64 ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(cd_offset));
  u16(cd, 0);
  put(cd.data(), cd.size());
  TORCH_CHECK(::fsync(fd_) == 0, "fsdp-ckpt: fsync of '", path_, "' failed: ", std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
}

}  // namespace fsdp::state::format
