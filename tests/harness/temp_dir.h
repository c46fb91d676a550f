#pragma once
// A temporary directory that is removed, with everything in it, when the object
// that owns it goes out of scope: also when a gtest ASSERT returns early or the
// test body throws, so a test run leaves nothing behind in /tmp.
//
// Only the process that made a directory owns it. A rank worker that is handed
// its launcher's directory through the environment borrows it and never removes
// it; the launcher removes it after its workers have exited.
#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp::testing {

class TempDir {
 public:
  /// Makes /tmp/<prefix>XXXXXX (mkdtemp) and owns it.
  static TempDir create(const std::string& prefix) {
    std::string path = "/tmp/" + prefix + "XXXXXX";
    TORCH_CHECK(::mkdtemp(path.data()) != nullptr, "test harness: mkdtemp(", path,
                ") failed: ", std::strerror(errno));
    return TempDir(std::move(path), /*owned=*/true);
  }
  /// The directory named by environment variable `var` when it is set (borrowed:
  /// a worker using its launcher's directory), else a new one from create(prefix).
  static TempDir from_env_or_create(const char* var, const std::string& prefix) {
    if (const char* dir = std::getenv(var)) return TempDir(dir, /*owned=*/false);
    return create(prefix);
  }

  TempDir(TempDir&& other) noexcept
      : path_(std::move(other.path_)), owned_(std::exchange(other.owned_, false)) {}
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  TempDir& operator=(TempDir&&) = delete;
  ~TempDir() {
    if (!owned_) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    if (ec) std::cerr << "test harness: could not remove " << path_ << ": " << ec.message() << "\n";
  }

  const std::string& path() const { return path_; }

 private:
  TempDir(std::string path, bool owned) : path_(std::move(path)), owned_(owned) {}
  std::string path_;
  bool owned_;
};

}  // namespace fsdp::testing
