// [Note: boxes of a flat range] in dcp_boxes.h.
#include "dcp_boxes.h"

namespace fsdp::state::dcp {

namespace dcp_boxes_detail {

// Boxes of [begin, end) inside the tensor of shape[d:], each prefixed by `prefix` (the
// indices of dims [0, d), size 1 each).
void boxes_from(const std::vector<int64_t>& shape, size_t d, std::vector<int64_t>& prefix, int64_t begin,
                int64_t end, std::vector<Chunk>& out) {
  if (begin >= end) return;
  const size_t dims = shape.size();
  auto box = [&](int64_t first_row, int64_t rows) {
    Chunk c;
    c.offsets = prefix;
    c.sizes.assign(prefix.size(), 1);
    c.offsets.push_back(first_row);
    c.sizes.push_back(rows);
    for (size_t j = d + 1; j < dims; ++j) {
      c.offsets.push_back(0);
      c.sizes.push_back(shape[j]);
    }
    out.push_back(std::move(c));
  };
  if (d + 1 == dims) return box(begin, end - begin);
  int64_t row = 1;  // elements per index of dim d
  for (size_t j = d + 1; j < dims; ++j) row *= shape[j];
  int64_t first = begin / row, last = end / row;  // rows [first, last) may be whole
  if (begin % row != 0) {
    // The tail of row `first` (or a piece inside it), then the rest from the next row.
    const int64_t stop = std::min(end, (first + 1) * row);
    prefix.push_back(first);
    boxes_from(shape, d + 1, prefix, begin - first * row, stop - first * row, out);
    prefix.pop_back();
    if (stop == end) return;
    first += 1;
  }
  if (last > first) box(first, last - first);
  if (end % row != 0 && last >= first) {
    prefix.push_back(last);
    boxes_from(shape, d + 1, prefix, 0, end - last * row, out);
    prefix.pop_back();
  }
}

}  // namespace dcp_boxes_detail

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<Chunk> boxes_of(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Chunk> out;
  if (shape.empty()) {
    if (begin < end) out.push_back(Chunk{});
    return out;
  }
  std::vector<int64_t> prefix;
  dcp_boxes_detail::boxes_from(shape, 0, prefix, begin, end, out);
  return out;
}

std::vector<Run> runs_of(const std::vector<int64_t>& shape, const Chunk& box) {
  const size_t dims = shape.size();
  if (dims == 0) return {Run{0, 0, 1}};
  if (numel_of(box.sizes) == 0) return {};
  // Dims from `k` on form one run per index of dims [0, k): the last dim, and every dim
  // before it whose trailing dims are whole.
  size_t k = dims - 1;
  while (k > 0 && box.sizes[k] == shape[k] && box.offsets[k] == 0) --k;
  int64_t run = 1;
  for (size_t j = k; j < dims; ++j) run *= box.sizes[j];
  std::vector<int64_t> stride(dims, 1);
  for (size_t j = dims - 1; j > 0; --j) stride[j - 1] = stride[j] * shape[j];
  std::vector<Run> out;
  std::vector<int64_t> index(k, 0);  // over the box's dims [0, k)
  for (int64_t local = 0;; local += run) {
    int64_t flat = 0;
    for (size_t j = 0; j < dims; ++j) flat += (box.offsets[j] + (j < k ? index[j] : 0)) * stride[j];
    out.push_back(Run{flat, local, run});
    size_t j = k;
    while (j > 0 && ++index[j - 1] == box.sizes[j - 1]) index[--j] = 0;
    if (j == 0) break;
  }
  return out;
}

}  // namespace fsdp::state::dcp
