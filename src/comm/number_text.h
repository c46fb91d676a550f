#pragma once
// Internal to src/comm: numbers as error messages write them.
#include <cstdint>
#include <string>

namespace fsdp::comm::detail {

/// 4096 -> "4,096".
inline std::string with_thousands(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

}  // namespace fsdp::comm::detail
