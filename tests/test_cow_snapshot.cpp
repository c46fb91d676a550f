// Copy-on-write snapshots ([Note: copy-on-write snapshots] in src/memory/cow_snapshot.h), one
// process: a writer thread receives exactly the bytes of the snapshot while the training
// thread overwrites them (also two training threads racing on the same pages); a full side
// buffer makes training wait for the writer, and release() frees it; pages taken first are never copied; a write to a chunk in the writer's
// hands waits for it; bad regions and takes are refused; the kernel gets EFAULT on a protected
// page (the Note's rule for receive buffers); and faults that are not a snapshot's still
// crash, through whatever handler was there before.
#include <signal.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "memory/cow_snapshot.h"
#include "memory/page_mapping.h"

namespace {

using fsdp::memory::CowOptions;
using fsdp::memory::CowRegion;
using fsdp::memory::CowSnapshot;
using fsdp::memory::CowStats;
using fsdp::memory::PageMapping;

const size_t kPage = PageMapping::page_size();
constexpr size_t kMiB = size_t{1} << 20;

// Generation `gen` of the bytes of a region: every 8-byte word differs from its neighbours
// and from the same word of other generations.
uint64_t word(size_t i, uint64_t gen) { return (i + 1) * 0x9E3779B97F4A7C15ull ^ (gen + 1) * 0xC2B2AE3D27D4EB4Full; }

void fill(void* p, size_t bytes, uint64_t gen) {
  auto* w = static_cast<volatile uint64_t*>(p);  // one store per word: every page faults
  for (size_t i = 0; i < bytes / 8; ++i) w[i] = word(i, gen);
}

// The first byte offset where `p` is not generation `gen`, or -1.
int64_t first_difference(const void* p, size_t bytes, uint64_t gen) {
  const auto* w = static_cast<const uint64_t*>(p);
  for (size_t i = 0; i < bytes / 8; ++i) {
    if (w[i] != word(i, gen)) return static_cast<int64_t>(i * 8);
  }
  return -1;
}

// What a writer received from take(): the iovecs concatenated at the range's offset.
struct Received {
  std::vector<char> bytes;
  explicit Received(size_t n) : bytes(n, 0) {}
  CowSnapshot::ChunkFn at(size_t offset) {
    return [this, offset](const struct iovec* iov, int n) mutable {
      for (int i = 0; i < n; ++i) {
        std::memcpy(bytes.data() + offset, iov[i].iov_base, iov[i].iov_len);
        offset += iov[i].iov_len;
      }
    };
  }
};

// Aborts the test process when a scenario outlives `seconds`: a deadlock fails in seconds
// instead of at ctest's timeout.
class Watchdog {
 public:
  Watchdog(int seconds, const char* what) : thread_([this, seconds, what] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::seconds(seconds), [this] { return done_; })) {
        std::fprintf(stderr, "test_cow_snapshot: '%s' still running after %d s: deadlock?\n", what, seconds);
        std::abort();
      }
    }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

void wait_until(const std::function<bool()>& ready) {
  while (!ready()) std::this_thread::sleep_for(std::chrono::microseconds(100));
}

// Runs `body`, which must throw E with `words` in its message.
template <typename E>
void expect_refused(const std::function<void()>& body, const std::string& words) {
  try {
    body();
    ADD_FAILURE() << "not refused; expected a message with '" << words << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(CowSnapshot, SlowWriterGetsThePreSnapshotBytes) {
  Watchdog watchdog(120, "SlowWriterGetsThePreSnapshotBytes");
  // 64 MiB in two regions: all of one mapping, and the middle of another whose edges stay
  // outside the snapshot (and writable).
  PageMapping a(40 * kMiB), b(32 * kMiB);
  char* const b_region = static_cast<char*>(b.data()) + 4 * kMiB;
  const std::vector<CowRegion> regions{{a.data(), 40 * kMiB}, {b_region, 24 * kMiB}};
  for (const auto& r : regions) fill(r.base, r.bytes, 0);
  const CowOptions options{/*copy_cap_bytes=*/64 * kMiB, /*chunk_bytes=*/kMiB};

  CowSnapshot snapshot(regions, options);
  std::atomic<bool> training_started{false};
  std::vector<Received> received{Received(regions[0].bytes), Received(regions[1].bytes)};
  std::thread writer([&] {
    wait_until([&] { return training_started.load(); });  // so that some pages are copied
    for (size_t r = regions.size(); r-- > 0;) {            // any order: backwards
      for (size_t off = regions[r].bytes; off > 0;) {
        off -= kMiB;
        snapshot.take(r, off, kMiB, received[r].at(off));
        std::this_thread::sleep_for(std::chrono::microseconds(300));
      }
    }
  });
  for (uint64_t gen = 1; gen <= 3; ++gen) {
    for (const auto& r : regions) {
      fill(r.base, kPage, gen);
      training_started = true;
      fill(r.base, r.bytes, gen);
    }
    fill(b.data(), 4 * kMiB, gen);  // outside the snapshot: no fault
  }
  writer.join();
  const CowStats during = snapshot.stats();
  snapshot.release();

  for (size_t r = 0; r < regions.size(); ++r) {
    EXPECT_EQ(first_difference(received[r].bytes.data(), regions[r].bytes, 0), -1)
        << "region " << r << ": the writer got bytes written after the snapshot";
    EXPECT_EQ(first_difference(regions[r].base, regions[r].bytes, 3), -1)
        << "region " << r << ": training's last writes are not all there after release";
  }
  EXPECT_GT(during.pages_copied, 0) << "training wrote before the writer began: those pages are copied";
  EXPECT_LE(during.pages_copied, static_cast<int64_t>(options.copy_cap_bytes / kPage));
  EXPECT_EQ(during.copy_bytes, during.pages_copied * static_cast<int64_t>(kPage));
  const auto chunk_pages = static_cast<int64_t>(kMiB / kPage);
  EXPECT_LE(during.pages_copied, during.faults * chunk_pages) << "a fault copies at most the rest of its chunk";
  EXPECT_LE(during.faults, 2 * static_cast<int64_t>(64 * kMiB / kMiB))
      << "training writes front to back: a chunk faults once to be copied (or once more, in the writer's hands)";
  EXPECT_GT(during.protect_ns, 0);
  std::cout << "64 MiB snapshot: protect_ns " << during.protect_ns << ", faults " << during.faults
            << ", pages_copied " << during.pages_copied << " (" << during.copy_bytes / kMiB << " MiB), fault_ns "
            << during.fault_ns << " (" << (during.faults ? during.fault_ns / during.faults : 0) << " per fault), wait_ns "
            << during.wait_ns << "\n";
}

TEST(CowSnapshot, FullSideBufferMakesTrainingWaitForTheWriter) {
  Watchdog watchdog(60, "FullSideBufferMakesTrainingWaitForTheWriter");
  const size_t bytes = 16 * kMiB;
  PageMapping m(bytes);
  fill(m.data(), bytes, 0);
  const CowOptions options{/*copy_cap_bytes=*/kMiB, /*chunk_bytes=*/kMiB};
  const int64_t cap_pages = static_cast<int64_t>(kMiB / kPage);
  const size_t chunks = bytes / kMiB;

  CowSnapshot snapshot({{m.data(), bytes}}, options);
  Received received(bytes);
  std::atomic<size_t> chunks_in_writer{0};
  std::thread writer([&] {
    // Training fills the side buffer and then waits: the writer starts only then.
    wait_until([&] { return snapshot.stats().pages_copied == cap_pages; });
    for (size_t c = 0; c < chunks; ++c) {
      auto collect = received.at(c * kMiB);
      snapshot.take(0, c * kMiB, kMiB, [&](const struct iovec* iov, int n) {
        chunks_in_writer.fetch_add(1);
        collect(iov, n);
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  fill(m.data(), bytes, 1);
  const size_t chunks_when_written = chunks_in_writer.load();
  fill(m.data(), bytes, 2);
  writer.join();
  const CowStats stats = snapshot.stats();
  snapshot.release();

  EXPECT_EQ(chunks_when_written, chunks) << "training finished overwriting before the writer had every chunk";
  EXPECT_EQ(stats.pages_copied, cap_pages) << "copies stop at the side buffer's size";
  EXPECT_EQ(first_difference(received.bytes.data(), bytes, 0), -1);
  EXPECT_EQ(first_difference(m.data(), bytes, 2), -1);
}

TEST(CowSnapshot, TwoTrainingThreadsRacingOnEveryPage) {
  Watchdog watchdog(60, "TwoTrainingThreadsRacingOnEveryPage");
  // Both threads fault on the same pages at once (one copies, the other waits for it), and
  // the side buffer holds half the region, so both also wait for the writer.
  const size_t bytes = 8 * kMiB;
  PageMapping m(bytes);
  fill(m.data(), bytes, 0);
  CowSnapshot snapshot({{m.data(), bytes}}, CowOptions{/*copy_cap_bytes=*/bytes / 2, /*chunk_bytes=*/kMiB});
  const int64_t cap_pages = static_cast<int64_t>(bytes / 2 / kPage);
  Received received(bytes);
  std::thread writer([&] {
    wait_until([&] { return snapshot.stats().pages_copied == cap_pages; });  // both wait now
    for (size_t off = bytes; off > 0;) {
      off -= kMiB;
      snapshot.take(0, off, kMiB, received.at(off));
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  });
  const auto train = [&](uint64_t gen) { fill(m.data(), bytes, gen); };
  std::thread t1(train, 1), t2(train, 2);
  t1.join();
  t2.join();
  writer.join();
  const CowStats stats = snapshot.stats();
  snapshot.release();
  EXPECT_EQ(first_difference(received.bytes.data(), bytes, 0), -1);
  EXPECT_EQ(stats.pages_copied, cap_pages);
  EXPECT_LE(stats.pages_copied, stats.faults * static_cast<int64_t>(kMiB / kPage))
      << "a fault copies at most the rest of its chunk";
}

TEST(CowSnapshot, PagesTakenFirstAreNotCopied) {
  const size_t bytes = 8 * kMiB;
  PageMapping m(bytes);
  fill(m.data(), bytes, 0);
  CowSnapshot snapshot({{m.data(), bytes}});
  Received received(bytes);
  snapshot.take(0, 0, bytes, received.at(0));  // eight chunks in one call
  fill(m.data(), bytes, 1);
  EXPECT_EQ(snapshot.stats().pages_copied, 0);
  EXPECT_EQ(snapshot.stats().faults, 0) << "taken pages are writable again";
  EXPECT_EQ(first_difference(received.bytes.data(), bytes, 0), -1);
  EXPECT_EQ(first_difference(m.data(), bytes, 1), -1);
}

TEST(CowSnapshot, WriteToAChunkInTheWritersHandsWaitsForIt) {
  Watchdog watchdog(30, "WriteToAChunkInTheWritersHandsWaitsForIt");
  const size_t bytes = 2 * kMiB;
  PageMapping m(bytes);
  fill(m.data(), bytes, 0);
  CowSnapshot snapshot({{m.data(), bytes}}, CowOptions{/*copy_cap_bytes=*/kMiB, /*chunk_bytes=*/kMiB});
  char* const base = static_cast<char*>(m.data());
  Received received(bytes);
  std::atomic<bool> in_fn{false}, chunk1_written{false}, fn_done{false};
  bool fn_gave_up = false;
  std::thread writer([&] {
    auto collect = received.at(0);
    snapshot.take(0, 0, kMiB, [&](const struct iovec* iov, int n) {
      in_fn = true;
      // The write to chunk 1 must go through while this chunk is in hand.
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!chunk1_written && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      fn_gave_up = !chunk1_written;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a slow writev
      collect(iov, n);
      fn_done = true;
    });
  });
  wait_until([&] { return in_fn.load(); });
  std::memset(base + kMiB + 5 * kPage, 0x11, kPage);  // chunk 1: copied, no wait
  chunk1_written = true;
  std::memset(base + 3 * kPage, 0x22, kPage);  // chunk 0, in the writer's hands: waits
  const bool written_after_fn = fn_done.load();
  writer.join();
  snapshot.take(0, kMiB, kMiB, received.at(kMiB));
  const CowStats stats = snapshot.stats();

  EXPECT_FALSE(fn_gave_up) << "the write to chunk 1 waited for the writer's chunk 0";
  EXPECT_TRUE(written_after_fn) << "the write to chunk 0 went on while the writer held it";
  EXPECT_EQ(first_difference(received.bytes.data(), bytes, 0), -1);
  EXPECT_EQ(stats.pages_copied, static_cast<int64_t>(kMiB / kPage) - 5)
      << "chunk 1's pages from the one written to the chunk's end (one fault copies them all)";
  EXPECT_EQ(stats.faults, 2);
  EXPECT_EQ(static_cast<unsigned char>(base[3 * kPage]), 0x22);
}

TEST(CowSnapshot, ReleaseFreesATrainingThreadWaitingForTheWriter) {
  Watchdog watchdog(30, "ReleaseFreesATrainingThreadWaitingForTheWriter");
  PageMapping m(4 * kPage);
  fill(m.data(), m.bytes(), 0);
  CowSnapshot snapshot({{m.data(), m.bytes()}}, CowOptions{/*copy_cap_bytes=*/0, /*chunk_bytes=*/kPage});
  std::atomic<bool> written{false};
  std::thread training([&] {
    static_cast<volatile char*>(m.data())[kPage] = 7;  // no side buffer and no writer: waits
    written = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(written.load()) << "the write went through with no room to copy its page";
  snapshot.release();
  training.join();
  EXPECT_TRUE(written.load());
  EXPECT_EQ(static_cast<char*>(m.data())[kPage], 7);
  EXPECT_EQ(snapshot.stats().pages_copied, 0);
  snapshot.release();  // again: nothing
}

TEST(CowSnapshot, KeepsTheInterruptedCodesErrno) {
  PageMapping m(kPage);
  CowSnapshot snapshot({{m.data(), m.bytes()}});
  errno = EXDEV;
  static_cast<volatile char*>(m.data())[0] = 1;
  EXPECT_EQ(errno, EXDEV);
  EXPECT_EQ(snapshot.stats().faults, 1);
}

TEST(CowSnapshot, RefusesBadRegionsAndOptions) {
  PageMapping m(4 * kPage);
  char* const p = static_cast<char*>(m.data());
  expect_refused<std::invalid_argument>([&] { CowSnapshot s({{p + 8, kPage}}); }, "page boundary");
  expect_refused<std::invalid_argument>([&] { CowSnapshot s({{p, kPage + 8}}); }, "multiple of the page size");
  expect_refused<std::invalid_argument>([&] { CowSnapshot s({{p, 0}}); }, "leave it out");
  expect_refused<std::invalid_argument>([&] { CowSnapshot s({{p + kPage, 2 * kPage}, {p, 2 * kPage}}); }, "overlap");
  expect_refused<std::invalid_argument>([&] { CowSnapshot s({{p, kPage}}, CowOptions{0, kPage + 1}); },
                                        "chunk_bytes");
  expect_refused<std::invalid_argument>([&] { CowSnapshot s({{p, kPage}}, CowOptions{0, 2048 * kPage}); },
                                        "IOV_MAX");
  // Nothing refused stayed protected (a write there would crash) or registered.
  fill(p, m.bytes(), 1);
  CowSnapshot ok({{p, kPage}, {p + kPage, kPage}});
  EXPECT_EQ(ok.region_count(), 2u);
}

TEST(CowSnapshot, RefusesBadAndRepeatedTakes) {
  PageMapping m(4 * kPage);
  char* const p = static_cast<char*>(m.data());
  CowSnapshot snapshot({{p, 4 * kPage}});
  const auto ignore = [](const struct iovec*, int) {};
  expect_refused<std::invalid_argument>([&] { snapshot.take(1, 0, kPage, ignore); }, "region 1 of 1");
  expect_refused<std::invalid_argument>([&] { snapshot.take(0, 8, kPage, ignore); }, "whole pages");
  expect_refused<std::invalid_argument>([&] { snapshot.take(0, 3 * kPage, 2 * kPage, ignore); }, "inside the region");
  snapshot.take(0, 0, 2 * kPage, ignore);
  expect_refused<std::logic_error>([&] { snapshot.take(0, kPage, 2 * kPage, ignore); }, "taken already");
  int calls = 0;
  expect_refused<std::runtime_error>(
      [&] {
        snapshot.take(0, 2 * kPage, kPage, [&](const struct iovec*, int) {
          ++calls;
          throw std::runtime_error("disk full");
        });
      },
      "disk full");
  EXPECT_EQ(calls, 1);
  p[2 * kPage] = 1;  // given back although fn threw: writable, no wait
  expect_refused<std::logic_error>([&] { snapshot.take(0, 2 * kPage, kPage, ignore); }, "taken already");
  snapshot.release();
  expect_refused<std::logic_error>([&] { snapshot.take(0, 3 * kPage, kPage, ignore); }, "released");
}

TEST(CowSnapshot, AtMostFourAliveAtOnce) {
  PageMapping m(8 * kPage);
  char* const p = static_cast<char*>(m.data());
  std::vector<std::unique_ptr<CowSnapshot>> alive;
  for (int i = 0; i < CowSnapshot::kMaxLiveSnapshots; ++i) {
    alive.push_back(std::make_unique<CowSnapshot>(std::vector<CowRegion>{{p + i * kPage, kPage}}));
  }
  expect_refused<std::runtime_error>([&] { CowSnapshot s({{p + 7 * kPage, kPage}}); }, "alive already");
  p[7 * kPage] = 1;  // the refused one protected nothing
  alive[1]->release();
  CowSnapshot again({{p + 7 * kPage, kPage}});
  p[kPage] = 1;  // released: writable, no fault
  EXPECT_EQ(alive[1]->stats().faults, 0);
}

// [Note: copy-on-write snapshots]: the kernel does not fault on a protected page, it fails.
TEST(CowSnapshot, KernelWriteIntoAProtectedPageFailsWithEfault) {
  PageMapping m(kPage);
  fill(m.data(), kPage, 0);
  CowSnapshot snapshot({{m.data(), kPage}});
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const char message[] = "bytes a peer sent";
  ASSERT_EQ(::write(fds[1], message, sizeof(message)), static_cast<ssize_t>(sizeof(message)));
  errno = 0;
  EXPECT_EQ(::read(fds[0], m.data(), sizeof(message)), -1);
  EXPECT_EQ(errno, EFAULT);
  EXPECT_EQ(snapshot.stats().faults, 0) << "no signal: the handler never saw it";
  EXPECT_EQ(first_difference(m.data(), kPage, 0), -1);
  snapshot.take(0, 0, kPage, [](const struct iovec*, int) {});
  EXPECT_EQ(::read(fds[0], m.data(), sizeof(message)), static_cast<ssize_t>(sizeof(message)));
  EXPECT_STREQ(static_cast<const char*>(m.data()), message);
  ::close(fds[0]);
  ::close(fds[1]);
}

// Death tests run in a fresh process (threadsafe style), so each installs the handler it
// chains to before the process's first snapshot installs ours.
class CowSnapshotDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

// A live snapshot, so the handler is installed, then a write to `target`. A fault the handler
// swallowed would retry forever: SIGALRM ends the child instead (and fails the expectation).
void write_with_a_snapshot_alive(volatile char* target) {
  ::alarm(5);
  static PageMapping m(kPage);
  static CowSnapshot snapshot({{m.data(), kPage}});
  *target = 1;
}

volatile char* protected_page(int prot) {
  static PageMapping m(kPage);
  ::mprotect(m.data(), kPage, prot);
  return static_cast<volatile char*>(m.data());
}

TEST_F(CowSnapshotDeathTest, OrdinaryCrashesStillCrash) {
  const auto with_default = [](volatile char* target) {
    ::signal(SIGSEGV, SIG_DFL);
    write_with_a_snapshot_alive(target);
  };
  EXPECT_EXIT(with_default(nullptr), ::testing::KilledBySignal(SIGSEGV), "");
  EXPECT_EXIT(with_default(protected_page(PROT_NONE)), ::testing::KilledBySignal(SIGSEGV), "");
  // A write fault on a read-only page that no snapshot holds.
  EXPECT_EXIT(with_default(protected_page(PROT_READ)), ::testing::KilledBySignal(SIGSEGV), "");
}

void plain_handler(int) {
  static const char text[] = "plain handler ran";
  (void)!::write(2, text, sizeof(text) - 1);
  ::_exit(43);
}

void info_handler(int, siginfo_t* info, void*) {
  static const char text[] = "sigaction handler ran for the address";
  if (info->si_addr != nullptr) ::_exit(45);
  (void)!::write(2, text, sizeof(text) - 1);
  ::_exit(44);
}

TEST_F(CowSnapshotDeathTest, ChainsToTheHandlerItFound) {
  const auto with_plain = [] {
    ::signal(SIGSEGV, plain_handler);
    write_with_a_snapshot_alive(nullptr);
  };
  EXPECT_EXIT(with_plain(), ::testing::ExitedWithCode(43), "plain handler ran");
  const auto with_info = [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = info_handler;
    sa.sa_flags = SA_SIGINFO;
    ::sigaction(SIGSEGV, &sa, nullptr);
    write_with_a_snapshot_alive(nullptr);
  };
  EXPECT_EXIT(with_info(), ::testing::ExitedWithCode(44), "sigaction handler ran");
}

TEST_F(CowSnapshotDeathTest, AFaultOnAReleasedSnapshotsPagesStillCrashes) {
  // release() leaves a second's grace for faults raised before it gave the pages back; a
  // page protected again by someone else after that is an ordinary crash.
  const auto reprotect_and_write = [] {
    ::signal(SIGSEGV, SIG_DFL);
    ::alarm(5);
    PageMapping m(kPage);
    { CowSnapshot snapshot({{m.data(), kPage}}); }
    ::mprotect(m.data(), kPage, PROT_READ);
    static_cast<volatile char*>(m.data())[0] = 1;
  };
  EXPECT_EXIT(reprotect_and_write(), ::testing::KilledBySignal(SIGSEGV), "");
}

}  // namespace
