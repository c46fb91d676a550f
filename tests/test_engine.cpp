// The mechanics FSDP and ZeRO share (src/engine/), one process, against sequences and
// values worked out by hand: the window of reductions in flight, fixed buckets filled in
// any order, and placement "auto".
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/fixed_buckets.h"
#include "engine/placement.h"
#include "engine/reduction_window.h"
#include "memory/device_memory.h"

namespace {

using fsdp::engine::FixedBuckets;
using fsdp::engine::ReductionWindow;

// A reduction whose landing the test decides; completing it appends its name to a log.
class Scripted : public ReductionWindow::Reduction {
 public:
  Scripted(std::string name, std::vector<std::string>* log, bool landed = false, int64_t bytes = 0)
      : name_(std::move(name)), log_(log), landed_(landed), bytes_(bytes) {}
  bool landed() const override { return landed_; }
  void complete() override { log_->push_back(name_); }
  int64_t held_bytes() const override { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::vector<std::string>* log_;
  bool landed_;
  int64_t bytes_;
};

TEST(ReductionWindow, MakeRoomCompletesTheOldestInOrder) {
  std::vector<std::string> log;
  ReductionWindow w(2);
  for (const char* n : {"a", "b", "c", "d"}) {
    w.make_room();
    w.push(std::make_unique<Scripted>(n, &log, false, 10));
  }
  EXPECT_EQ(log, (std::vector<std::string>{"a", "b"})) << "a window of two holds c and d";
  EXPECT_EQ(w.size(), 2);
  EXPECT_EQ(w.held_bytes(), 20);
  w.complete_all();
  EXPECT_EQ(log, (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_TRUE(w.empty());
}

TEST(ReductionWindow, CompleteLandedStopsAtTheFirstInFlight) {
  std::vector<std::string> log;
  ReductionWindow w(0);  // unbounded
  w.push(std::make_unique<Scripted>("a", &log, true));
  w.push(std::make_unique<Scripted>("b", &log, false));
  w.push(std::make_unique<Scripted>("c", &log, true));
  w.complete_landed();
  EXPECT_EQ(log, (std::vector<std::string>{"a"})) << "c landed, but b before it did not: order is kept";
  EXPECT_EQ(w.size(), 2);
}

TEST(ReductionWindow, HandsCompletedReductionsToItsOwner) {
  std::vector<std::string> log, kept;
  ReductionWindow second(0);
  ReductionWindow first(1, [&](std::unique_ptr<ReductionWindow::Reduction> r) {
    kept.push_back(static_cast<Scripted&>(*r).name());
    second.push(std::move(r));
  });
  first.push(std::make_unique<Scripted>("a", &log));
  first.make_room();
  first.push(std::make_unique<Scripted>("b", &log));
  EXPECT_EQ(kept, (std::vector<std::string>{"a"}));
  EXPECT_EQ(second.size(), 1);
  second.complete_all();
  EXPECT_EQ(log, (std::vector<std::string>{"a", "a"})) << "completed once in each window";
}

TEST(ReductionWindow, ForEachBucketInterleavesIssueAndDone) {
  std::vector<std::string> log;
  auto issue = [&](int b) {
    log.push_back("issue" + std::to_string(b));
    return fsdp::comm::CommHandle();
  };
  auto done = [&](int b) { log.push_back("done" + std::to_string(b)); };
  fsdp::engine::for_each_bucket(3, 2, issue, done);
  EXPECT_EQ(log, (std::vector<std::string>{"issue0", "issue1", "done0", "issue2", "done1", "done2"}));
  log.clear();
  fsdp::engine::for_each_bucket(2, 1, issue, done);
  EXPECT_EQ(log, (std::vector<std::string>{"issue0", "done0", "issue1", "done1"}));
}

// Bucket 0: members 0 (2 elements) and 1 (3), padded to 6; bucket 1: member 2 (1), padded to 2.
FixedBuckets two_buckets() {
  return FixedBuckets({{0, 0, 2}, {0, 2, 3}, {1, 0, 1}}, {{0, 2, 5, 6}, {2, 3, 1, 2}}, /*max_idle=*/2,
                      [](size_t n) { return c10::GetAllocator(c10::DeviceType::CPU)->allocate(n); });
}

TEST(FixedBuckets, ReadyBucketsIssueInBucketOrder) {
  FixedBuckets k = two_buckets();
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  k.arrive(2, torch::tensor({7.f}), opts);
  EXPECT_EQ(k.state(1), FixedBuckets::State::kReady);
  EXPECT_FALSE(k.next_ready().has_value()) << "bucket 1 waits for bucket 0";
  k.arrive(1, torch::tensor({3.f, 4.f, 5.f}), opts);
  EXPECT_EQ(k.state(0), FixedBuckets::State::kFilling);
  EXPECT_FALSE(k.next_ready().has_value());
  k.arrive(0, torch::tensor({1.f, 2.f}), opts);
  EXPECT_EQ(*k.next_ready(), 0u);
  EXPECT_EQ(*k.next_ready(), 1u);
  EXPECT_FALSE(k.next_ready().has_value());
  EXPECT_TRUE(torch::equal(k.buffer(0), torch::tensor({1.f, 2.f, 3.f, 4.f, 5.f, 0.f})));
  EXPECT_TRUE(torch::equal(k.buffer(1), torch::tensor({7.f, 0.f})));
  EXPECT_EQ(k.bytes(), 8 * 4);
  k.reduced(0);
  k.reduced(1);
  EXPECT_EQ(k.state(0), FixedBuckets::State::kEmpty);
  EXPECT_EQ(k.bytes(), 0);
  EXPECT_FALSE(k.arrived(0));
}

TEST(FixedBuckets, FillRestGivesZerosToMembersThatDidNotArrive) {
  FixedBuckets k = two_buckets();
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  k.arrive(1, torch::tensor({3.f, 4.f, 5.f}), opts);
  k.fill_rest(opts);
  EXPECT_EQ(*k.next_ready(), 0u);
  EXPECT_EQ(*k.next_ready(), 1u);
  EXPECT_TRUE(torch::equal(k.buffer(0), torch::tensor({0.f, 0.f, 3.f, 4.f, 5.f, 0.f})));
  EXPECT_TRUE(torch::equal(k.buffer(1), torch::zeros({2})));
  k.reduced(0);
  k.reduced(1);
  k.restart();
  k.arrive(0, torch::tensor({1.f, 2.f}), opts);
  EXPECT_EQ(k.state(0), FixedBuckets::State::kFilling) << "the next backward starts from bucket 0";
}

TEST(Placement, PiecesThatFitMoveInOrder) {
  // Margin 1000 - 200 = 800, ratio 0.5: a budget of 400 bytes.
  fsdp::memory::set_device_memory_probe_for_testing(
      [](const c10::Device&) { return fsdp::memory::DeviceMemory{1000, 200}; });
  torch::optim::SGD sgd(std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())}, 0.1);
  std::vector<fsdp::engine::OffloadedPiece> pieces(4);
  pieces[0].tensor_bytes = 300;
  pieces[1].tensor_bytes = 200;  // does not fit after the first
  pieces[2].tensor_bytes = 100;
  pieces[3].tensor_bytes = 1;    // the budget is spent
  std::vector<size_t> moved;
  const auto chosen = fsdp::engine::place_on_device(pieces, sgd, c10::Device(c10::kCPU), 0.5,
                                                    [&](size_t i) { moved.push_back(i); });
  fsdp::memory::set_device_memory_probe_for_testing(nullptr);
  EXPECT_EQ(chosen, (std::vector<uint8_t>{1, 0, 1, 0}));
  EXPECT_EQ(moved, (std::vector<size_t>{0, 2}));
}

}  // namespace
