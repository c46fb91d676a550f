#include "mnist.h"

#include <stdexcept>

#include <zlib.h>

namespace fsdp::train {

namespace {

// IDX: big-endian u32 magic (0x0801 labels, 0x0803 images), then one u32 per dimension,
// then the data as unsigned bytes.
std::vector<uint8_t> read_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw std::runtime_error("cannot open " + path);
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) out.insert(out.end(), buf, buf + n);
  int err = 0;
  std::string what = n < 0 ? gzerror(f, &err) : "";
  gzclose(f);
  if (n < 0) throw std::runtime_error("cannot decompress " + path + ": " + what);
  return out;
}

uint32_t be32(const std::vector<uint8_t>& b, size_t at) {
  return (uint32_t(b[at]) << 24) | (uint32_t(b[at + 1]) << 16) | (uint32_t(b[at + 2]) << 8) | b[at + 3];
}

}  // namespace

Split load_split(const std::string& dir, const std::string& prefix) {
  Split s;
  const std::string ipath = dir + "/" + prefix + "-images-idx3-ubyte.gz";
  const std::string lpath = dir + "/" + prefix + "-labels-idx1-ubyte.gz";

  auto img = read_gzip(ipath);
  if (img.size() < 16 || be32(img, 0) != 0x803)
    throw std::runtime_error(ipath + " is not an IDX image file (expected magic 0x00000803)");
  s.images.count = be32(img, 4);
  s.images.rows = be32(img, 8);
  s.images.cols = be32(img, 12);
  const size_t want = size_t(s.images.count * s.images.rows * s.images.cols);
  if (img.size() - 16 != want)
    throw std::runtime_error(ipath + ": header says " + std::to_string(want) + " pixel bytes, file has " +
                             std::to_string(img.size() - 16));
  s.images.pixels.assign(img.begin() + 16, img.end());

  auto lab = read_gzip(lpath);
  if (lab.size() < 8 || be32(lab, 0) != 0x801)
    throw std::runtime_error(lpath + " is not an IDX label file (expected magic 0x00000801)");
  const int64_t nlabels = be32(lab, 4);
  if (nlabels != s.images.count || int64_t(lab.size()) - 8 != nlabels)
    throw std::runtime_error(lpath + ": " + std::to_string(nlabels) + " labels for " +
                             std::to_string(s.images.count) + " images in " + ipath);
  s.labels.assign(lab.begin() + 8, lab.end());
  for (uint8_t l : s.labels)
    if (l > 9) throw std::runtime_error(lpath + ": label " + std::to_string(l) + " outside 0..9");
  return s;
}

}  // namespace fsdp::train
