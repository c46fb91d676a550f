#pragma once
// The text of what a call throws, for the tests of error messages.
#include <exception>
#include <functional>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp::testing {

/// What `fn` throws, as a user reads it (a c10::Error without its C++ backtrace); "" when
/// it throws nothing.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace fsdp::testing
