#pragma once
// Internal to src/state: what an exception says to a user (a c10::Error without the C++
// backtrace its what() carries), for errors that are passed on inside other messages.
#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp::state {

inline std::string error_message(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

}  // namespace fsdp::state
