#pragma once
// Bytes written as hex in a test (files Python wrote, embedded), back to bytes.
#include <string>

namespace fsdp::testing {

inline std::string from_hex(const char* hex) {
  std::string out;
  for (const char* p = hex; p[0] && p[1]; p += 2)
    out.push_back(static_cast<char>(std::stoi(std::string(p, 2), nullptr, 16)));
  return out;
}

}  // namespace fsdp::testing
