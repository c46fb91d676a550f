#include "object_collectives.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"

namespace fsdp::comm {

std::string broadcast_object(const ProcessGroup& pg, const std::string& bytes, int root, const CallLabel& label) {
  if (pg.size() == 1) return bytes;
  auto len = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong);
  broadcast(pg, len, root, label).wait();
  const int64_t n = len.item<int64_t>();
  auto buf = torch::zeros({std::max<int64_t>(n, 1)}, torch::kUInt8);  // never an empty message
  if (pg.rank() == root) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
  broadcast(pg, buf, root, label).wait();
  return std::string(reinterpret_cast<const char*>(buf.data_ptr()), n);
}

std::vector<std::string> all_gather_object(const ProcessGroup& pg, const std::string& bytes,
                                           const CallLabel& label) {
  if (pg.size() == 1) return {bytes};
  // Equal-sized slots (all_gather_into's chunks): the longest string plus an
  // 8-byte length header in each.
  auto len = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong);
  all_reduce(pg, len, ReduceOp::kMax, label).wait();
  const int64_t slot = std::max<int64_t>(len.item<int64_t>(), 1) + 8;
  auto mine = torch::zeros({slot}, torch::kUInt8);
  auto* m = mine.data_ptr<uint8_t>();
  const uint64_t n = bytes.size();
  std::memcpy(m, &n, 8);
  std::memcpy(m + 8, bytes.data(), bytes.size());
  auto all = torch::empty({slot * pg.size()}, torch::kUInt8);
  all_gather_into(pg, all, mine, label).wait();
  std::vector<std::string> out;
  const auto* a = all.data_ptr<uint8_t>();
  for (int r = 0; r < pg.size(); ++r) {
    uint64_t k;
    std::memcpy(&k, a + r * slot, 8);
    out.emplace_back(reinterpret_cast<const char*>(a + r * slot + 8), k);
  }
  return out;
}

}  // namespace fsdp::comm

namespace fsdp::comm::detail {

namespace {

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string l; std::getline(is, l);) out.push_back(l);
  return out;
}

// Index of the first line where `mine` and `root` differ; -1 when they agree.
int64_t first_difference(const std::vector<std::string>& mine, const std::vector<std::string>& root) {
  for (size_t i = 0; i < std::max(mine.size(), root.size()); ++i)
    if (i >= mine.size() || i >= root.size() || mine[i] != root[i]) return static_cast<int64_t>(i);
  return -1;
}

std::string line_or_none(const std::vector<std::string>& lines, int64_t i, const std::string& item) {
  return i < static_cast<int64_t>(lines.size()) ? "'" + lines[i] + "'" : "no such " + item;
}

}  // namespace

void check_same_on_all_ranks(const ProcessGroup& pg, const std::vector<std::string>& lines,
                             const SameOnAllRanksText& text) {
  if (pg.size() == 1) return;
  std::string mine;
  for (const std::string& l : lines) mine += l + "\n";
  const std::vector<std::string> root = split_lines(broadcast_object(pg, mine, 0, {Phase::kSetup, text.who}));
  // Every rank learns every rank's first difference, so all raise the same error.
  auto flags = at::zeros({pg.size()}, at::kLong);
  flags[pg.rank()] = first_difference(lines, root) + 1;
  all_reduce(pg, flags, ReduceOp::kSum, {Phase::kSetup, text.who}).wait();
  for (int r = 0; r < pg.size(); ++r) {
    const int64_t i = flags[r].item<int64_t>() - 1;
    if (i < 0) continue;
    const std::string this_rank = r == pg.rank() ? ", this rank has " + line_or_none(lines, i, text.item) : "";
    TORCH_CHECK(false, text.who, ": ", text.what_differs, " across ranks (seen on rank ", pg.rank(), "): rank ", r,
                " differs from rank 0 at ", text.item, " #", i, ": rank 0 has ", line_or_none(root, i, text.item),
                this_rank, ". ", text.fix);
  }
}

}  // namespace fsdp::comm::detail
