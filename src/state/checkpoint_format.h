#pragma once
// The checkpoint directory format (docs/checkpoint-format.md), independent of
// FSDP: records, the metadata file, CRC-32, and the file reads and writes.
//
// [Note: checkpoint records]
// A *record* is a contiguous run of raw little-endian elements in one rank file:
// the elements [begin, end) of the flattened (row-major) value of one *item* (a
// parameter, a buffer, one optimizer-state tensor of a parameter, or a user
// extra tensor). An item saved at world size N is split into at most N records
// (one per rank piece, some empty); together they cover [0, numel) exactly once.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "direct_file.h"

namespace fsdp::state::format {

constexpr const char* kMetadataFile = "metadata.json";
constexpr const char* kFormatName = "fsdp-cpp-checkpoint";
constexpr int kFormatVersion = 1;

std::string rank_file_name(int rank);  // "shard_rank00003.bin"

// Kinds of items.
constexpr const char* kParam = "param";
constexpr const char* kBuffer = "buffer";
constexpr const char* kExtra = "extra";
// Optimizer-state kinds are the state tensor's name ("exp_avg", "momentum_buffer", ...).

struct Record {
  std::string item;     // parameter / buffer / extra name
  std::string kind;     // kParam, kBuffer, kExtra or an optimizer-state tensor name
  std::string file;     // rank file name
  int64_t offset = 0;   // bytes into the file
  int64_t begin = 0, end = 0;  // element range of the flattened item
  std::string dtype;    // dtype_name()
  uint32_t crc32 = 0;   // of the record's bytes
};
void to_json(nlohmann::json& j, const Record& r);
void from_json(const nlohmann::json& j, Record& r);

struct ItemInfo {
  std::vector<int64_t> shape;
  std::string dtype;
};

std::string dtype_name(at::ScalarType t);          // "float32", "bfloat16", ... (torch's names)
at::ScalarType parse_dtype(const std::string& s);  // throws on unknown names

uint32_t crc32_of(const void* data, size_t n, uint32_t crc = 0);

// memcpy for a load's commit: copies of at least kStreamingCopyMin bytes use
// non-temporal (streaming) stores. [Note: streaming commit copies]
constexpr size_t kStreamingCopyMin = size_t(1) << 20;
void copy_out(void* dst, const void* src, size_t n);

// Appends records to one file: writes, checksums, fsync on close.
//
// [Note: staging device tensors]
// A record of a tensor that is not in host memory (a CUDA model's parameter piece,
// optimizer state or buffer) goes through one host staging buffer of at most
// staging_chunk_bytes() (64 MiB; pinned for CUDA): each chunk is copied to the host,
// written, and checksummed while it is still in the CPU cache, then the buffer takes the
// next chunk. So a save holds one chunk of host memory beyond what the model holds, whatever
// the model's size, and the record's CRC-32 is known when write() returns. Host tensors
// take the path below unchanged (no copy).
//
// [Note: checksums overlap the fsync]
// write() only hands the bytes to the file (and asks the kernel to start writing
// back what went through the page cache); the CRC-32s are computed in finish(), from the
// tensors' memory, while another thread waits in fsync for the disk. The disk
// is the bottleneck of a save, so the checksums cost (almost) nothing. The
// writer keeps a reference to every written tensor until finish(); the caller
// must not modify them in between (save_checkpoint does not).
//
// [Note: aligned records]
// In a checkpoint's rank file (Layout::kAligned) each record starts `skew` bytes after a
// 4096-byte boundary, the gap before it zeros; the metadata gives every record's offset, so
// no reader assumes records are adjacent. A record's skew is the byte offset of its first
// element in its storage, modulo 4096: state on pages of its own (memory/own_pages.h)
// starts on a page boundary, so such a record's bytes and its place in the file are then
// equally far from a page boundary, and all its whole pages go to the disk straight from
// memory ([Note: direct writes] in direct_file.h). The skew comes from the storage offset,
// not the address, so the file's bytes do not depend on where the state lives (a blocking
// save writes what an asynchronous one would). safetensors and DCP files are kPacked:
// their formats want records adjacent.
class RankFileWriter {
 public:
  enum class Layout { kPacked, kAligned };
  RankFileWriter(const std::string& dir, std::string file_name, Layout layout = Layout::kPacked);
  ~RankFileWriter();
  // Writes t (contiguous; any device) as a record of elements [begin, end) of `item`.
  // Its crc32 is filled in by finish() (a host tensor) or here (a device tensor, staged).
  // `skew`: [Note: aligned records] (ignored by kPacked).
  void write(const std::string& item, const std::string& kind, const at::Tensor& t, int64_t begin, int64_t end,
             size_t skew = 0);
  // Bytes that cannot wait for finish() (a copy-on-write snapshot's pages go back to training
  // once written): `produce` hands the record's bytes, in order, to the sink it is given, which
  // checksums and writes each piece at once.
  using Sink = std::function<void(const char*, size_t)>;
  void write_streamed(const std::string& item, const std::string& kind, at::ScalarType dtype, int64_t begin,
                      int64_t end, const std::function<void(const Sink&)>& produce, size_t skew = 0);
  // Bytes that are no record, before the first (a safetensors file's header). file_crc()
  // covers the records only.
  void write_preamble(const std::string& bytes);
  // Checksums every record while fsync runs, closes; returns the file size.
  int64_t finish();
  const std::string& name() const { return name_; }
  // Every record written, with checksums (valid after finish()).
  const std::vector<Record>& records() const { return records_; }
  uint32_t file_crc() const { return file_crc_; }
  // Bytes that went to the disk straight from memory ([Note: direct writes]).
  int64_t direct_bytes() const { return file_.direct_bytes(); }

 private:
  std::string name_;
  DirectFile file_;
  Layout layout_;
  int64_t size_ = 0;            // the end of the last record (or of the preamble)
  int64_t records_begin_ = 0;   // the preamble's end: file_crc() starts there
  int64_t cursor_ = 0;          // where write_bytes() writes next
  uint32_t file_crc_ = 0;
  std::vector<Record> records_;
  std::vector<at::Tensor> pending_;  // records_[i]'s bytes, until checksummed (undefined: staged, done)
  at::Tensor staging_;               // host bytes a device record passes through, chunk by chunk

  void write_bytes(const char* p, size_t nbytes);
  // The next record (where the layout puts it), without its checksum; the cursor moves there.
  Record next_record(const std::string& item, const std::string& kind, at::ScalarType dtype, int64_t begin,
                     int64_t end, size_t skew);
  // `r`'s nbytes are in the file: starts their write-back and keeps the record (`unchecked`:
  // the tensor finish() checksums it from; undefined when r.crc32 is known).
  void append(Record r, size_t nbytes, at::Tensor unchecked);
  // [Note: staging device tensors]: returns the CRC-32 of t's bytes.
  uint32_t write_staged(const at::Tensor& t);
};

// The chunk size of [Note: staging device tensors] (set_checkpoint_staging_chunk_bytes).
size_t staging_chunk_bytes();

// Reads records of a checkpoint directory, checking sizes and checksums.
class RankFileReader {
 public:
  explicit RankFileReader(std::string dir) : dir_(std::move(dir)) {}
  ~RankFileReader();
  // The record's bytes through `buf` (`buf_bytes` at a time, so they stay in the
  // CPU cache): each chunk goes to `sink` right after it is read and checksummed.
  // The CRC (error names the file) is checked when the whole record has gone by,
  // so on an error `sink` has seen bytes that are wrong: a caller writes them only
  // to a file it then discards. (Loads verify through MappedRecords instead.)
  void stream(const Record& r, char* buf, size_t buf_bytes, const std::function<void(const char*, size_t)>& sink);

 private:
  int fd_of(const std::string& file);
  std::string dir_;
  std::map<std::string, int> fds_;
};

// Read-only views of a checkpoint's records, through mmap of its rank files: a
// load first verifies every record it needs (bounds and CRC-32, in the page
// cache) and copies the bytes into the model only after every rank has verified
// its own ([Note: atomic load] in checkpoint_load.cpp). Files are mapped on first use
// and unmapped when this object goes; the pointers verified() returns stay valid
// until then.
class MappedRecords {
 public:
  explicit MappedRecords(std::string dir) : dir_(std::move(dir)) {}
  ~MappedRecords();
  MappedRecords(const MappedRecords&) = delete;
  MappedRecords& operator=(const MappedRecords&) = delete;
  // The record's bytes, after checking that the file holds them and that their
  // CRC-32 matches (errors name the file and the record). A record is checked
  // once however often it is asked for. nullptr for an empty record.
  const char* verified(const Record& r);

 private:
  struct File {
    const char* base = nullptr;
    size_t size = 0;
  };
  const File& file_of(const std::string& name);
  std::string dir_;
  std::map<std::string, File> files_;
  std::map<std::pair<std::string, int64_t>, const char*> checked_;  // (file, offset) -> bytes
};

/// Writes all n bytes to `fd` (retrying short writes and EINTR); throws "<who>: writing
/// '<path>' failed: <reason>" otherwise.
void write_all(int fd, const void* data, size_t n, const char* who, const std::string& path);

void write_file_synced(const std::string& path, const std::string& contents);
void fsync_dir(const std::string& dir);
std::string read_text_file(const std::string& path);

}  // namespace fsdp::state::format
