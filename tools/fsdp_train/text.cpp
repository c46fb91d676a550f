#include "text.h"

#include <fstream>
#include <iterator>
#include <stdexcept>

namespace fsdp::train {

std::string check_text_size(const std::string& path, int64_t total, int64_t context) {
  const int64_t val = validation_size(total), train = total - val;
  if (val >= context + 1 && train >= context + 1) return "";
  // The smallest total whose last tenth holds context+1 bytes.
  const int64_t need = 10 * (context + 1);
  return "--text " + path + " has " + std::to_string(total) + " bytes: too short for --context " +
         std::to_string(context) + " (its last 10%, the validation part, must hold a window of " +
         std::to_string(context + 1) + " bytes, so at least " + std::to_string(need) +
         " bytes in all); use a longer file or a smaller --context";
}

TextCorpus load_text(const std::string& path, int64_t context) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("--text " + path + ": cannot open the file");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw std::runtime_error("--text " + path + ": read error");
  if (std::string e = check_text_size(path, int64_t(bytes.size()), context); !e.empty())
    throw std::runtime_error(e);
  const size_t val = size_t(validation_size(int64_t(bytes.size())));
  TextCorpus c;
  c.train.assign(bytes.begin(), bytes.end() - std::ptrdiff_t(val));
  c.validation.assign(bytes.end() - std::ptrdiff_t(val), bytes.end());
  return c;
}

}  // namespace fsdp::train
