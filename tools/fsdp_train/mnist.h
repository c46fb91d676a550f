#pragma once
/// Fashion-MNIST in the IDX format (gzip'd, as Debian's dataset-fashion-mnist ships it),
/// read whole into memory: 60000 + 10000 images of 28x28 bytes, ~55 MB. Torch-free.

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::train {

struct IdxImages {
  int64_t count = 0, rows = 0, cols = 0;
  std::vector<uint8_t> pixels;  ///< count * rows * cols, row-major
};

struct Split {
  IdxImages images;
  std::vector<uint8_t> labels;  ///< count entries, 0..9
};

/// Reads `<dir>/<prefix>-images-idx3-ubyte.gz` and `<dir>/<prefix>-labels-idx1-ubyte.gz`
/// (prefix "train" or "t10k"). Throws std::runtime_error naming the file and what was wrong
/// (missing, not gzip/IDX, wrong magic, truncated, counts that disagree).
Split load_split(const std::string& dir, const std::string& prefix);

}  // namespace fsdp::train
