#pragma once
// Internal to src/comm: strings in and out of a c10d::Store, which holds bytes.
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::comm::detail {

inline std::vector<uint8_t> store_bytes(const std::string& s) { return {s.begin(), s.end()}; }
inline std::string store_string(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

}  // namespace fsdp::comm::detail
