// Python interop of full state dicts (tests/scripts/test_python_interop.sh).
//   state_dict_interop save MODEL.pt OUT.pt   FSDP model (world 1) -> FULL state dict
//                                             for Python, plus its output on a fixed input
//   state_dict_interop load MODEL.pt OUT.pt   Python-saved state dict -> FSDP model; checks
//                                             its output against Python's (exit 1 if not)
//   state_dict_interop load-rank0 MODEL.pt OUT.pt  the same, but only rank 0 reads the file
//                                             (map_full_state_dict + load_state_dict_from_rank0);
//                                             run under fsdp-run for several ranks
//   state_dict_interop checkpoint DIR FULL.pt one Adam step, then save_checkpoint(DIR) and
//                                             the FULL state dict (rank 0) for comparison;
//                                             run under fsdp-run for several ranks
//   state_dict_interop tied DIR FULL.pt       the same with a tied-weight model (below); also
//                                             writes its output on a fixed input to FULL.pt.out
// The model is torch.nn.Sequential(Linear(13,32), ReLU, Linear(32,17), ReLU, Linear(17,5)).
// The tied model: embed.weight [11, 6] is head.weight (one tensor), mid = Linear(6, 6);
// forward(x [B, 11]) = tanh(mid(x @ embed.weight)) @ head.weight^T.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include <torch/torch.h>

#include "common/tool_error.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/state/rank0_load.h"
#include "fsdp/state/state_dict.h"

namespace {

struct HolderImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit HolderImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
};
TORCH_MODULE(Holder);
struct TiedNetImpl : torch::nn::Module {
  Holder embed{nullptr}, head{nullptr};
  torch::nn::Linear mid{nullptr};
  TiedNetImpl() {
    auto w = torch::randn({11, 6}) * 0.4;
    embed = register_module("embed", Holder(w));
    mid = register_module("mid", torch::nn::Linear(6, 6));
    head = register_module("head", Holder(w));  // the same tensor: tied
  }
  torch::Tensor forward(torch::Tensor x) {
    return torch::tanh(mid(x.matmul(embed->weight))).matmul(head->weight.t());
  }
};
TORCH_MODULE(TiedNet);

void save_tensor(const torch::Tensor& t, const std::string& path) {
  const auto bytes = torch::pickle_save(c10::IValue(t));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The single-process run's own store directory, removed on every return from
// run(). Declared before the process group, so removed after the store is closed.
struct StoreDir {
  std::string path;
  ~StoreDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

static int run(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: state_dict_interop save|load|load-rank0|checkpoint|tied MODEL.pt|DIR OUT.pt\n";
    return 2;
  }
  const std::string mode = argv[1], model_path = argv[2], out_path = argv[3];
  StoreDir store_dir;
  fsdp::comm::ProcessGroup pg;
  if (std::getenv("RANK")) {
    pg = fsdp::comm::init_process_group(fsdp::comm::InitOptions());  // under fsdp-run / torchrun
  } else {
    char tmpl[] = "/tmp/fsdp-interop-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::cerr << "state_dict_interop: mkdtemp(" << tmpl << ") failed: " << std::strerror(errno) << "\n";
      return 2;
    }
    store_dir.path = tmpl;
    const std::string store = store_dir.path + "/store";
    fsdp::comm::LaunchOverrides ov;
    ov.rank = 0;
    ov.world_size = 1;
    pg = fsdp::comm::init_process_group(fsdp::comm::InitOptions().file_store_path(store).overrides(ov));
  }
  torch::manual_seed(42);
  if (mode == "tied") {
    fsdp::FullyShardedDataParallel<TiedNetImpl> model(TiedNet(), pg);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    const auto x = torch::linspace(-1, 1, 4 * 11).reshape({4, 11});
    torch::mse_loss(model->forward(x), torch::ones({4, 11})).backward();
    opt.step();
    fsdp::save_checkpoint(model_path, *model, &opt);
    fsdp::StateDictTypeGuard guard(*model, fsdp::StateDictType::kFull, fsdp::FullStateDictConfig().rank0_only(true));
    auto sd = fsdp::state_dict(*model);
    if (pg.rank() == 0) fsdp::save_full_state_dict(sd, out_path);
    torch::NoGradGuard no_grad;
    const auto y = model->forward(x);  // collective: every rank
    if (pg.rank() == 0) save_tensor(y, out_path + ".out");
    return 0;
  }
  auto net = torch::nn::Sequential(torch::nn::Linear(13, 32), torch::nn::ReLU(), torch::nn::Linear(32, 17),
                                   torch::nn::ReLU(), torch::nn::Linear(17, 5));
  fsdp::FullyShardedDataParallel model(net, pg,
                                       fsdp::Options().auto_wrap_policy(fsdp::always_wrap_policy()));
  const auto x = torch::linspace(-1, 1, 4 * 13).reshape({4, 13});
  if (mode == "checkpoint") {
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    const auto y = torch::ones({4, 5});
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
    fsdp::save_checkpoint(model_path, *model, &opt);
    fsdp::StateDictTypeGuard guard(*model, fsdp::StateDictType::kFull, fsdp::FullStateDictConfig().rank0_only(true));
    auto sd = fsdp::state_dict(*model);
    if (pg.rank() == 0) fsdp::save_full_state_dict(sd, out_path);
    const auto osd = fsdp::full_optim_state_dict(*model, opt);  // rank 0 holds it
    if (pg.rank() == 0) fsdp::save_optim_state_dict(osd, out_path + ".optim");
    return 0;
  }
  if (mode == "save") {
    fsdp::StateDictTypeGuard guard(*model, fsdp::StateDictType::kFull,
                                   fsdp::FullStateDictConfig().offload_to_cpu(true).rank0_only(true));
    fsdp::save_full_state_dict(fsdp::state_dict(*model), model_path);
    torch::NoGradGuard no_grad;
    const auto y = model->forward(x);
    const auto bytes = torch::pickle_save(c10::IValue(y));
    std::ofstream(out_path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return 0;
  }
  if (mode == "load-rank0") {
    fsdp::StateDict dict;  // empty on the other ranks
    if (pg.rank() == 0) dict = fsdp::map_full_state_dict(model_path);
    fsdp::load_state_dict_from_rank0(*model, dict);
  } else {
    fsdp::load_state_dict(*model, fsdp::load_full_state_dict(model_path));
  }
  std::ifstream in(out_path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto expected = torch::pickle_load(bytes).toTensor();
  torch::NoGradGuard no_grad;
  const auto y = model->forward(x);
  const double diff = (y - expected).abs().max().item<double>();
  std::cout << "max |C++ - Python| = " << diff << "\n";
  return diff < 1e-5 ? 0 : 1;
}

// Errors are caught here rather than left to std::terminate, so that run()'s
// locals are destroyed and its store directory removed.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    fsdp::tools::print_exception("state_dict_interop", e);
    return 1;
  } catch (const std::exception& e) {
    fsdp::tools::print_exception("state_dict_interop", e);
    return 1;
  }
}
