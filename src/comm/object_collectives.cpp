#include "object_collectives.h"

#include <algorithm>
#include <cstring>

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
  all_reduce(pg, len, ReduceOp::Max, label).wait();
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
