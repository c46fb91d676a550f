#pragma once
// Internal to src/state: what an exception says to a user (a c10::Error without the C++
// backtrace its what() carries), for errors that are passed on inside other messages: to
// the other ranks, or into a list.
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace fsdp::state {

inline std::string error_message(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

/// "" when `fn` returns; else what it threw, as a user reads it (for a rank to tell the
/// others before they all fail alike).
template <typename Fn>
std::string failure_of(Fn&& fn) {
  try {
    fn();
    return "";
  } catch (const std::exception& e) {
    return error_message(e);
  }
}

/// "'a', 'b', 'c'": the first `shown` names quoted, then "and N more".
inline std::string names_text(const std::vector<std::string>& names, size_t shown = 20) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size() && i < shown; ++i) os << (i ? ", " : "") << "'" << names[i] << "'";
  if (names.size() > shown) os << " and " << names.size() - shown << " more";
  return os.str();
}

}  // namespace fsdp::state
