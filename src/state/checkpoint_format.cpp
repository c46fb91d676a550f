#include "checkpoint_format.h"
#include "checkpoint_testing.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>

namespace fsdp::state::format {

std::string rank_file_name(int rank) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "shard_rank%05d.bin", rank);
  return buf;
}

void to_json(nlohmann::json& j, const Record& r) {
  j = nlohmann::json{{"item", r.item}, {"kind", r.kind},   {"file", r.file},   {"offset", r.offset},
                     {"begin", r.begin}, {"end", r.end}, {"dtype", r.dtype}, {"crc32", r.crc32}};
}
void from_json(const nlohmann::json& j, Record& r) {
  j.at("item").get_to(r.item);
  j.at("kind").get_to(r.kind);
  j.at("file").get_to(r.file);
  j.at("offset").get_to(r.offset);
  j.at("begin").get_to(r.begin);
  j.at("end").get_to(r.end);
  j.at("dtype").get_to(r.dtype);
  j.at("crc32").get_to(r.crc32);
}

namespace {
const std::pair<at::ScalarType, const char*> kDtypes[] = {
    {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"}, {at::kBFloat16, "bfloat16"},
    {at::kLong, "int64"},    {at::kInt, "int32"},      {at::kShort, "int16"},  {at::kChar, "int8"},
    {at::kByte, "uint8"},    {at::kBool, "bool"},
};
}  // namespace

std::string dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.first == t) return d.second;
  TORCH_CHECK(false, "fsdp checkpoint: dtype ", t, " is not supported in checkpoints");
}

at::ScalarType parse_dtype(const std::string& s) {
  for (const auto& d : kDtypes)
    if (s == d.second) return d.first;
  TORCH_CHECK(false, "fsdp checkpoint: unknown dtype '", s, "' in metadata");
}

namespace {
// libdeflate's CRC-32 is zlib's polynomial and convention (crc32(0, ...) of the
// same bytes gives the same value) but uses carry-less multiplication: several
// times faster than zlib's table-driven loop, and the checksum is what bounds a
// load on a busy machine. Taken at run time when the shared library is present
// (Debian ships it without a -dev package in this image); zlib otherwise.
using Crc32Fn = uint32_t (*)(uint32_t, const void*, size_t);
std::atomic<bool> force_zlib{false};  // set_checkpoint_crc_zlib (checkpoint_testing.h)
Crc32Fn fast_crc32() {
  if (force_zlib.load(std::memory_order_relaxed)) return nullptr;
  static const Crc32Fn fn = [] {
    void* lib = ::dlopen("libdeflate.so.0", RTLD_NOW | RTLD_LOCAL);
    return lib ? reinterpret_cast<Crc32Fn>(::dlsym(lib, "libdeflate_crc32")) : nullptr;
  }();
  return fn;
}
}  // namespace

uint32_t crc32_of(const void* data, size_t n, uint32_t crc) {
  if (auto fn = fast_crc32()) return fn(crc, data, n);
  const auto* p = static_cast<const Bytef*>(data);
  // zlib takes uInt lengths: feed large buffers in 1 GiB steps.
  while (n > 0) {
    const size_t step = std::min<size_t>(n, size_t(1) << 30);
    crc = static_cast<uint32_t>(::crc32(crc, p, static_cast<uInt>(step)));
    p += step;
    n -= step;
  }
  return crc;
}

// [Note: streaming commit copies]
// A load's commit copies every verified record from the mapped page cache into
// parameters and optimizer state: hundreds of MB per rank, far beyond the CPU
// caches, in records of a few MB. glibc's memcpy switches to non-temporal stores
// only above a threshold derived from the L3 size (tens of MB here), so a 4 MB
// record is copied with ordinary stores, each of which first reads the
// destination line into the cache (read-for-ownership): three memory transfers
// per byte instead of two. Streaming stores write whole lines without reading
// them. The copied values are not used again during the load (the next use is a
// training step, by which time they would have left the cache anyway). The
// comparison with memcpy is bench_checkpoint's (docs/benchmarks.md).
void copy_out(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n >= kStreamingCopyMin) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;  // to a 16-byte boundary
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + i, s + i, n - i);
    _mm_sfence();  // streaming stores are weakly ordered: complete them before the commit returns
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

RankFileWriter::RankFileWriter(const std::string& dir, std::string file_name, Layout layout)
    : name_(file_name), file_(dir + "/" + file_name), layout_(layout) {}

RankFileWriter::~RankFileWriter() = default;

constexpr size_t kDefaultStagingChunkBytes = size_t(64) << 20;
std::atomic<size_t> staging_chunk{0};  // set_checkpoint_staging_chunk_bytes (checkpoint_testing.h); 0: default
std::atomic<bool> stage_host{false};    // set_checkpoint_stage_host_tensors (checkpoint_testing.h)

size_t staging_chunk_bytes() {
  const size_t n = staging_chunk.load(std::memory_order_relaxed);
  return n > 0 ? n : kDefaultStagingChunkBytes;
}

void write_all(int fd, const void* data, size_t n, const char* who, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t w = ::write(fd, p + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, who, ": writing '", path, "' failed: ", std::strerror(errno));
    done += static_cast<size_t>(w);
  }
}

void RankFileWriter::write_bytes(const char* p, size_t nbytes) {
  file_.write_at(cursor_, p, nbytes);
  cursor_ += static_cast<int64_t>(nbytes);
}

uint32_t RankFileWriter::write_staged(const at::Tensor& t) {
  const int64_t esize = static_cast<int64_t>(t.element_size());
  // Whole elements per chunk, at least one.
  const int64_t chunk_numel = std::max<int64_t>(1, static_cast<int64_t>(staging_chunk_bytes()) / esize);
  const int64_t numel = t.numel();
  const int64_t staging_bytes = std::min(numel, chunk_numel) * esize;
  if (!staging_.defined() || staging_.numel() < staging_bytes)
    staging_ = at::empty({staging_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(t.is_cuda()));
  const at::Tensor flat = t.view({-1});
  uint32_t crc = 0;
  for (int64_t first = 0; first < numel; first += chunk_numel) {
    const int64_t n = std::min(chunk_numel, numel - first);
    at::Tensor host = staging_.narrow(0, 0, n * esize).view(t.scalar_type());
    host.copy_(flat.narrow(0, first, n));  // synchronous: the bytes are on the host after it
    const char* p = static_cast<const char*>(host.data_ptr());
    write_bytes(p, static_cast<size_t>(n * esize));
    crc = crc32_of(p, static_cast<size_t>(n * esize), crc);
  }
  return crc;
}

Record RankFileWriter::next_record(const std::string& item, const std::string& kind, at::ScalarType dtype,
                                   int64_t begin, int64_t end, size_t skew) {
  const auto block = static_cast<int64_t>(DirectFile::kBlock);
  // An empty record takes no gap: the file ends where its last bytes do.
  const bool packed = layout_ == Layout::kPacked || end == begin;
  cursor_ = packed ? size_ : (size_ + block - 1) / block * block + int64_t(skew) % block;
  Record r;
  r.item = item;
  r.kind = kind;
  r.file = name_;
  r.offset = cursor_;
  r.begin = begin;
  r.end = end;
  r.dtype = dtype_name(dtype);
  return r;
}

void RankFileWriter::append(Record r, size_t nbytes, at::Tensor unchecked) {
  // Start the write-back of what this record left in the page cache now (asynchronous), so
  // the disk works while the next records are copied; the fsync in finish() makes it durable.
  if (nbytes > 0) file_.start_writeback(r.offset, nbytes);
  size_ = r.offset + static_cast<int64_t>(nbytes);
  records_.push_back(std::move(r));
  pending_.push_back(std::move(unchecked));
}

void RankFileWriter::write(const std::string& item, const std::string& kind, const at::Tensor& t, int64_t begin,
                           int64_t end, size_t skew) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && t.numel() == end - begin, "record ", item, "/", kind,
                        " is not a contiguous tensor of ", end - begin, " elements");
  Record r = next_record(item, kind, t.scalar_type(), begin, end, skew);
  const size_t nbytes = t.numel() * t.element_size();
  const bool staged = !t.device().is_cpu() || stage_host.load(std::memory_order_relaxed);  // [Note: staging device tensors]
  if (staged) r.crc32 = write_staged(t);
  else write_bytes(static_cast<const char*>(t.data_ptr()), nbytes);
  append(std::move(r), nbytes, staged ? at::Tensor() : t);
}

void RankFileWriter::write_streamed(const std::string& item, const std::string& kind, at::ScalarType dtype,
                                    int64_t begin, int64_t end, const std::function<void(const Sink&)>& produce,
                                    size_t skew) {
  Record r = next_record(item, kind, dtype, begin, end, skew);
  const size_t nbytes = static_cast<size_t>(end - begin) * c10::elementSize(dtype);
  size_t written = 0;
  uint32_t crc = 0;
  produce([&](const char* p, size_t n) {
    crc = crc32_of(p, n, crc);
    write_bytes(p, n);
    written += n;
  });
  TORCH_INTERNAL_ASSERT(written == nbytes, "record ", item, "/", kind, ": ", written, " bytes streamed, not ", nbytes);
  r.crc32 = crc;
  append(std::move(r), nbytes, at::Tensor());  // checksummed here
}

void RankFileWriter::write_preamble(const std::string& bytes) {
  TORCH_INTERNAL_ASSERT(records_.empty() && size_ == 0, "a preamble goes before every record");
  write_bytes(bytes.data(), bytes.size());
  size_ = records_begin_ = static_cast<int64_t>(bytes.size());
}

namespace {
// The CRC-32 of `n` zero bytes (the gaps of [Note: aligned records]: under two blocks).
uint32_t zeros_crc(size_t n) {
  static const std::vector<char> zeros(2 * DirectFile::kBlock, 0);
  TORCH_INTERNAL_ASSERT(n <= zeros.size(), "a gap of ", n, " bytes between records");
  return crc32_of(zeros.data(), n);
}
}  // namespace

int64_t RankFileWriter::finish() {
  // See [Note: checksums overlap the fsync].
  std::string sync_error;
  std::thread syncer([&] {
    try {
      file_.sync();
    } catch (const std::exception& e) {
      sync_error = e.what();
    }
  });
  int64_t end = records_begin_;
  for (size_t i = 0; i < records_.size(); ++i) {
    const at::Tensor& t = pending_[i];
    const size_t nbytes = static_cast<size_t>(records_[i].end - records_[i].begin) *
                          c10::elementSize(parse_dtype(records_[i].dtype));
    if (t.defined()) records_[i].crc32 = crc32_of(t.data_ptr(), nbytes);  // else staged: checksummed by write()
    // Whole-file CRC from the records' (and the gaps'), without a second pass over the bytes.
    const auto gap = static_cast<size_t>(records_[i].offset - end);
    if (gap > 0)
      file_crc_ = static_cast<uint32_t>(::crc32_combine(file_crc_, zeros_crc(gap), static_cast<z_off_t>(gap)));
    file_crc_ = static_cast<uint32_t>(::crc32_combine(file_crc_, records_[i].crc32, static_cast<z_off_t>(nbytes)));
    end = records_[i].offset + static_cast<int64_t>(nbytes);
  }
  syncer.join();
  pending_.clear();
  TORCH_CHECK(sync_error.empty(), sync_error);
  file_.close();
  return size_;
}

RankFileReader::~RankFileReader() {
  for (auto& kv : fds_) ::close(kv.second);
}

int RankFileReader::fd_of(const std::string& file) {
  auto it = fds_.find(file);
  if (it != fds_.end()) return it->second;
  const std::string path = dir_ + "/" + file;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "fsdp checkpoint: cannot open '", path, "': ", std::strerror(errno),
              " (the checkpoint is incomplete)");
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  fds_[file] = fd;
  return fd;
}

void RankFileReader::stream(const Record& r, char* buf, size_t buf_bytes,
                            const std::function<void(const char*, size_t)>& sink) {
  TORCH_INTERNAL_ASSERT(buf_bytes > 0);
  const int fd = fd_of(r.file);
  const size_t nbytes = (r.end - r.begin) * c10::elementSize(parse_dtype(r.dtype));
  // [Note: no explicit read-ahead]
  // Records are read in file order, and fd_of() marks the file sequential, so
  // the kernel's own read-ahead keeps the disk busy, in large page-cache folios.
  // An explicit POSIX_FADV_WILLNEED (used before) fills the cache with 4 KiB
  // folios instead, and every later read of those pages then pays per 4 KiB
  // (filemap_get_read_batch, folio_mark_accessed): ~15% of a cached load's copy.
  //
  // Chunk by chunk: each chunk is checksummed right after it is read, while it
  // is still in the CPU cache.
  uint32_t crc = 0;
  size_t done = 0;
  while (done < nbytes) {
    const size_t chunk_end = std::min(nbytes, done + buf_bytes);
    size_t got_in_chunk = 0;
    while (done < chunk_end) {
      const ssize_t got = ::pread(fd, buf + got_in_chunk, chunk_end - done, r.offset + static_cast<off_t>(done));
      if (got < 0 && errno == EINTR) continue;
      TORCH_CHECK(got > 0, "fsdp checkpoint: file '", dir_, "/", r.file, "' is truncated or unreadable: record ",
                  r.item, " (", r.kind, ") needs bytes [", r.offset, ", ", r.offset + static_cast<int64_t>(nbytes),
                  ")", got < 0 ? std::string(": ") + std::strerror(errno) : std::string(""));
      done += static_cast<size_t>(got);
      got_in_chunk += static_cast<size_t>(got);
    }
    crc = crc32_of(buf, got_in_chunk, crc);
    sink(buf, got_in_chunk);
  }
  TORCH_CHECK(crc == r.crc32, "fsdp checkpoint: checksum mismatch in file '", dir_, "/", r.file, "' for ", r.item,
              " (", r.kind, ", elements [", r.begin, ", ", r.end, ")): the file is corrupted; restore it or load an "
              "earlier checkpoint");
}

MappedRecords::~MappedRecords() {
  for (auto& kv : files_)
    if (kv.second.base) ::munmap(const_cast<char*>(kv.second.base), kv.second.size);
}

const MappedRecords::File& MappedRecords::file_of(const std::string& name) {
  auto it = files_.find(name);
  if (it != files_.end()) return it->second;
  const std::string path = dir_ + "/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "fsdp checkpoint: cannot open '", path, "': ", std::strerror(errno),
              " (the checkpoint is incomplete)");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(false, "fsdp checkpoint: cannot stat '", path, "': ", std::strerror(err));
  }
  File f;
  f.size = static_cast<size_t>(st.st_size);
  if (f.size > 0) {
    void* p = ::mmap(nullptr, f.size, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the file open
    TORCH_CHECK(p != MAP_FAILED, "fsdp checkpoint: cannot map '", path, "' (", f.size, " bytes): ",
                std::strerror(err));
    // Records are verified in file order: let the kernel read ahead.
    ::madvise(p, f.size, MADV_SEQUENTIAL);
    f.base = static_cast<const char*>(p);
  } else {
    ::close(fd);
  }
  return files_.emplace(name, f).first->second;
}

const char* MappedRecords::verified(const Record& r) {
  const size_t nbytes = static_cast<size_t>(r.end - r.begin) * c10::elementSize(parse_dtype(r.dtype));
  if (nbytes == 0) return nullptr;
  const auto key = std::make_pair(r.file, r.offset);
  auto done = checked_.find(key);
  if (done != checked_.end()) return done->second;
  const File& f = file_of(r.file);
  TORCH_CHECK(r.offset >= 0 && static_cast<size_t>(r.offset) + nbytes <= f.size, "fsdp checkpoint: file '", dir_,
              "/", r.file, "' is truncated: record ", r.item, " (", r.kind, ") needs bytes [", r.offset, ", ",
              r.offset + static_cast<int64_t>(nbytes), "), the file has ", f.size);
  const char* p = f.base + r.offset;
  TORCH_CHECK(crc32_of(p, nbytes) == r.crc32, "fsdp checkpoint: checksum mismatch in file '", dir_, "/", r.file,
              "' for ", r.item, " (", r.kind, ", elements [", r.begin, ", ", r.end, ")): the file is corrupted; "
              "restore it or load an earlier checkpoint");
  checked_.emplace(key, p);
  return p;
}

void write_file_synced(const std::string& path, const std::string& contents) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "fsdp checkpoint: cannot create '", path, "': ", std::strerror(errno));
  try {
    write_all(fd, contents.data(), contents.size(), "fsdp checkpoint", path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  const int rc = ::fsync(fd);
  ::close(fd);
  TORCH_CHECK(rc == 0, "fsdp checkpoint: fsync of '", path, "' failed");
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "fsdp checkpoint: cannot read '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace fsdp::state::format

namespace fsdp::state::detail {
void set_checkpoint_crc_zlib(bool on) { state::format::force_zlib.store(on, std::memory_order_relaxed); }
void set_checkpoint_staging_chunk_bytes(int64_t bytes) {
  state::format::staging_chunk.store(bytes > 0 ? static_cast<size_t>(bytes) : 0, std::memory_order_relaxed);
}
void set_checkpoint_stage_host_tensors(bool on) { state::format::stage_host.store(on, std::memory_order_relaxed); }
}  // namespace fsdp::state::detail
