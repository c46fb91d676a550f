#pragma once
/// How every command-line program of the project (fsdp-train, fsdp-run, fsdp-ckpt, the
/// examples, the benchmarks) reports a failure on stderr: one line "<tool>: <message>",
///  * without the C++ backtrace that c10::Error::what() appends (twenty "frame #N" lines
///    that say nothing to a user), unless PyTorch's own TORCH_SHOW_CPP_STACKTRACES=1 asks
///    for it;
///  * with the tool's name once, even when the message already starts with it.
/// Header-only and torch-free (fsdp-run links no torch): c10::Error is recognised by its
/// what_without_backtrace() member, so catch it by its own type and pass it here.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

namespace fsdp::tools {

/// PyTorch's switch for C++ backtraces in error messages.
inline bool show_cpp_stacktraces() {
  const char* v = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

namespace detail {
template <typename E, typename = void>
struct has_backtrace_free_what : std::false_type {};
template <typename E>
struct has_backtrace_free_what<E, std::void_t<decltype(std::declval<const E&>().what_without_backtrace())>>
    : std::true_type {};
}  // namespace detail

/// The text of an exception: for a c10::Error without its backtrace (with it under
/// TORCH_SHOW_CPP_STACKTRACES=1), for anything else what().
template <typename E>
std::string error_text(const E& e) {
  if constexpr (detail::has_backtrace_free_what<E>::value) {
    if (!show_cpp_stacktraces()) return e.what_without_backtrace();
  }
  return e.what();
}

/// `message` without leading copies of "<tool>: " (a library message that names the
/// tool already) and without trailing newlines.
inline std::string strip_tool_prefix(const char* tool, std::string message) {
  const std::string prefix = std::string(tool) + ": ";
  while (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
  while (!message.empty() && message.back() == '\n') message.pop_back();
  return message;
}

/// Prints "<tool>: <kind><message>" on stderr, e.g. kind "error: " or "FAILED: ".
inline void print_error(const char* tool, const std::string& message, const char* kind = "") {
  std::fprintf(stderr, "%s: %s%s\n", tool, kind, strip_tool_prefix(tool, message).c_str());
  std::fflush(stderr);
}

/// print_error for a caught exception (see error_text).
template <typename E>
void print_exception(const char* tool, const E& e, const char* kind = "") {
  print_error(tool, error_text(e), kind);
}

}  // namespace fsdp::tools
