#include "path_policy.h"

namespace fsdp::core::detail {

bool path_matches(const std::string& pattern, const std::string& path) {
  // Backtracking over the last `*` only: a `*` never crosses a '.', so the text one star
  // may take is bounded by its component.
  size_t p = 0, s = 0, star = std::string::npos, taken = 0;
  while (s < path.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      taken = s;
    } else if (p < pattern.size() && pattern[p] == path[s]) {
      ++p, ++s;
    } else if (star != std::string::npos && path[taken] != '.') {
      p = star + 1;
      s = ++taken;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace fsdp::core::detail
