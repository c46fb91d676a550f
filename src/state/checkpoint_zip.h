#pragma once
// A stored (uncompressed) zip writer producing the archive layout torch.save
// uses, so Python's torch.load and libtorch's PyTorchStreamReader read it:
//
//   <archive>/data.pkl, <archive>/data/<i>..., <archive>/version
//
// every record's data starting on a 64-byte boundary (padding in a local extra
// field "FB", as PyTorchStreamWriter does), ZIP64 fields where a size or an
// offset reaches 4 GiB.
//
// [Note: why not PyTorchStreamWriter]
// Its bundled miniz computes the CRC-32 one byte at a time (~0.4 GB/s), which
// bounds fsdp-ckpt consolidate far below the disk. This writer takes each
// record's CRC from the caller when it is already known (consolidate combines
// the checkpoint records' verified CRCs, so the bytes are never checksummed
// twice) and streams the bytes in caller-sized chunks, so a record never has to
// be assembled in memory. The output is fsync'd before finish() returns.

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::state::format {

class StoredZipWriter {
 public:
  // Creates (truncates) `path`; records are named "<archive_name>/<name>".
  StoredZipWriter(std::string path, std::string archive_name);
  ~StoredZipWriter();
  StoredZipWriter(const StoredZipWriter&) = delete;
  StoredZipWriter& operator=(const StoredZipWriter&) = delete;

  // A whole record from memory (CRC computed here).
  void write_record(const std::string& name, const void* data, uint64_t size);
  // A record streamed in chunks: begin_record, append() exactly `size` bytes,
  // end_record(). `crc32` is the CRC-32 of all of them, known up front (it goes
  // in the local header, before the data).
  void begin_record(const std::string& name, uint64_t size, uint32_t crc32);
  void append(const void* data, size_t n);
  void end_record();
  // The "version" record, the central directory; fsync, close.
  void finish();

  // Test hook: write ZIP64 fields for every record and the end of the central
  // directory even below 4 GiB, so readers' handling of them can be checked
  // without writing 4 GiB.
  void force_zip64(bool on) { force_zip64_ = on; }

 private:
  struct Entry {
    std::string name;
    uint64_t size = 0, offset = 0;
    uint32_t crc32 = 0;
  };
  void put(const void* data, size_t n);
  bool zip64_size(uint64_t size) const;
  bool zip64_offset(uint64_t offset) const;

  std::string path_, prefix_;
  int fd_ = -1;
  uint64_t pos_ = 0;             // bytes written so far
  uint64_t synced_ = 0;          // write-back requested up to here
  uint64_t record_left_ = 0;     // bytes the open record still expects
  bool in_record_ = false, force_zip64_ = false;
  std::vector<Entry> entries_;
};

}  // namespace fsdp::state::format
