// DirectFile ([Note: direct writes] in src/state/direct_file.h): whatever the offsets and the
// memory's alignment, the file holds exactly the bytes written (gaps read as zeros), whole
// aligned blocks go to the disk with O_DIRECT where the file system takes it, and with
// direct writes turned off the bytes are the same. The reference is a plain byte vector the
// test builds alongside.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "harness/error_of.h"
#include "harness/test_dir.h"
#include "state/checkpoint_testing.h"
#include "state/direct_file.h"

using fsdp::state::format::DirectFile;
namespace fs = std::filesystem;

namespace {

constexpr size_t kBlock = DirectFile::kBlock;

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

// Page-aligned random bytes (a tensor's storage on pages of its own).
struct Memory {
  explicit Memory(size_t n) : bytes(n) {
    base = static_cast<char*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    std::mt19937 gen(7);
    for (size_t i = 0; i < n; ++i) base[i] = static_cast<char>(gen());
  }
  ~Memory() { ::munmap(base, bytes); }
  char* base;
  size_t bytes;
};

// Records laid out as [Note: aligned records] says: each at a block boundary plus its skew.
// `matching`: the memory is as far from a page boundary as the file offset (direct-able);
// else one byte off (every byte through the page cache). Returns the expected file.
std::vector<char> write_records(DirectFile& f, const Memory& m, bool matching, int count) {
  std::mt19937 gen(11);
  std::vector<char> expected;
  int64_t end = 0;
  for (int k = 0; k < count; ++k) {
    const size_t skew = gen() % kBlock;
    const size_t n = gen() % (300 * 1024);
    const size_t at = (gen() % 64) * kBlock + skew + (matching ? 0 : 1);
    const int64_t offset = (end + int64_t(kBlock) - 1) / int64_t(kBlock) * int64_t(kBlock) + int64_t(skew);
    f.write_at(offset, m.base + at, n);
    if (expected.size() < size_t(offset) + n) expected.resize(size_t(offset) + n, 0);
    std::copy(m.base + at, m.base + at + n, expected.begin() + offset);
    end = offset + int64_t(n);
  }
  f.sync();
  return expected;
}

bool file_system_takes_direct_writes(const std::string& dir) {
  const Memory m(kBlock);
  DirectFile probe(dir + "/probe");
  probe.write_at(0, m.base, kBlock);
  return probe.direct_bytes() > 0;
}

}  // namespace

TEST(DirectFile, AlignedRecordsGoStraightFromMemory) {
  const std::string dir = fsdp::testing::test_dir();
  if (!file_system_takes_direct_writes(dir)) GTEST_SKIP() << dir << ": the file system refuses O_DIRECT";
  const Memory m(80 * kBlock + 300 * 1024);
  DirectFile f(dir + "/aligned.bin");
  const std::vector<char> expected = write_records(f, m, /*matching=*/true, 40);
  const int64_t direct = f.direct_bytes();
  f.close();
  EXPECT_EQ(read_file(dir + "/aligned.bin"), expected);
  // Every record's whole blocks: all but its partial first and last blocks.
  EXPECT_GT(direct, int64_t(expected.size()) / 2) << "most bytes should have bypassed the page cache";
  EXPECT_EQ(direct % int64_t(kBlock), 0);
}

TEST(DirectFile, MisalignedMemoryGoesThroughThePageCache) {
  const std::string dir = fsdp::testing::test_dir();
  const Memory m(80 * kBlock + 300 * 1024);
  DirectFile f(dir + "/misaligned.bin");
  const std::vector<char> expected = write_records(f, m, /*matching=*/false, 40);
  EXPECT_EQ(f.direct_bytes(), 0) << "memory one byte off a block boundary cannot be written directly";
  f.close();
  EXPECT_EQ(read_file(dir + "/misaligned.bin"), expected);
}

TEST(DirectFile, TurnedOffWritesTheSameBytes) {
  const std::string dir = fsdp::testing::test_dir();
  const Memory m(80 * kBlock + 300 * 1024);
  std::vector<char> direct_bytes, buffered_bytes;
  {
    DirectFile f(dir + "/on.bin");
    write_records(f, m, true, 25);
  }
  fsdp::state::detail::set_checkpoint_direct_io(false);
  {
    DirectFile f(dir + "/off.bin");
    EXPECT_FALSE(f.direct());
    write_records(f, m, true, 25);
    EXPECT_EQ(f.direct_bytes(), 0);
  }
  fsdp::state::detail::set_checkpoint_direct_io(true);
  EXPECT_EQ(read_file(dir + "/on.bin"), read_file(dir + "/off.bin"));
}

TEST(DirectFile, CreatingInAMissingDirectoryNamesThePath) {
  const std::string path = fsdp::testing::test_dir() + "/no/such/dir/file.bin";
  const std::string error = fsdp::testing::error_of([&] { DirectFile f(path); });
  EXPECT_NE(error.find("creating '" + path + "' failed: No such file or directory"), std::string::npos) << error;
}
