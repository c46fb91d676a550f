// fsdp-ckpt: offline tools for checkpoint directories (docs/checkpoint-format.md).
//   fsdp-ckpt inspect DIR [--no-verify]   names, shapes, dtypes, world size, sizes, checksums
//   fsdp-ckpt consolidate DIR OUT         one full state dict, torch.load-able in Python
#include <iostream>
#include <string>

#include "common/tool_error.h"
#include "fsdp/state/checkpoint_tools.h"

int main(int argc, char** argv) {
  const std::string usage =
      "usage: fsdp-ckpt inspect DIR [--no-verify]\n"
      "       fsdp-ckpt consolidate DIR OUT\n";
  if (argc < 3) {
    std::cerr << usage;
    return 2;
  }
  const std::string cmd = argv[1];
  try {
    if (cmd == "inspect" && (argc == 3 || (argc == 4 && std::string(argv[3]) == "--no-verify"))) {
      bool ok = true;
      std::cout << fsdp::inspect_checkpoint(argv[2], argc == 3, &ok);
      return ok ? 0 : 1;
    }
    if (cmd == "consolidate" && argc == 4) {
      fsdp::consolidate_checkpoint(argv[2], argv[3]);
      std::cout << "wrote " << argv[3] << "\n";
      return 0;
    }
  } catch (const c10::Error& e) {
    fsdp::tools::print_exception("fsdp-ckpt", e);
    return 1;
  } catch (const std::exception& e) {
    fsdp::tools::print_exception("fsdp-ckpt", e);
    return 1;
  }
  std::cerr << usage;
  return 2;
}
