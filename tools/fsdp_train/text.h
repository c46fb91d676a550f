#pragma once
/// The gpt's corpus: the raw bytes of a text file (byte-level, vocabulary 256), the first 90%
/// for training and the last 10% for validation. Torch-free.

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::train {

inline constexpr int64_t kVocabSize = 256;

struct TextCorpus {
  std::vector<uint8_t> train, validation;
};

/// Bytes of a `total`-byte file that go to validation (the last tenth).
inline int64_t validation_size(int64_t total) { return total / 10; }

/// Empty if a file of `total` bytes holds at least one window of context+1 bytes in each of
/// its parts, else the message (naming --text, --context and the fix).
std::string check_text_size(const std::string& path, int64_t total, int64_t context);

/// Reads `path` whole and splits it. Throws std::runtime_error naming the file when it cannot
/// be read or is too short for `context` (see check_text_size).
TextCorpus load_text(const std::string& path, int64_t context);

}  // namespace fsdp::train
