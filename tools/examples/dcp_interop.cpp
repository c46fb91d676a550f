// Python interop of DCP checkpoints (tests/scripts/test_dcp_interop.sh); run under fsdp-run.
//   dcp_interop continue DIR OUT.pt [STEPS] [bf16]
//       load_dcp(DIR) with Adam, then STEPS (default 1) Adam steps on the fixed batch, then the
//       FULL state dict (rank 0) to OUT.pt and the full optimizer state dict to OUT.pt.optim
//   dcp_interop save DIR OUT.pt [STEPS] [bf16]
//       STEPS (default 1) Adam steps from torch.manual_seed(42)'s weights, then save_dcp(DIR)
//       and the FULL state dict and optimizer state dict as above
// The model is torch.nn.Sequential(Linear(17, 13), ReLU, Linear(13, 5)) (13 x 17 splits
// mid-row at 3 ranks), every Linear a unit, FULL_SHARD; bf16: its parameters in bfloat16.
// The fixed batch: x = linspace(-1, 1, 4 * 17).reshape(4, 17), every rank the same 4
// samples; loss = out.square().mean().
#include <cstdlib>
#include <iostream>
#include <string>

#include <torch/torch.h>

#include "common/tool_error.h"
#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/dcp.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/state/state_dict.h"

namespace {

using Model = fsdp::FullyShardedDataParallel<torch::nn::SequentialImpl>;

void adam_steps(Model& model, torch::optim::Adam& opt, int steps, at::ScalarType dtype) {
  const auto x = torch::linspace(-1, 1, 4 * 17).reshape({4, 17}).to(dtype);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad(/*set_to_none=*/true);
    model->forward(x).to(at::kFloat).square().mean().backward();
    opt.step();
  }
}

void save_full(Model& model, torch::optim::Adam& opt, const fsdp::comm::ProcessGroup& pg, const std::string& out) {
  {
    fsdp::StateDictTypeGuard guard(*model, fsdp::StateDictType::kFull, fsdp::FullStateDictConfig().rank0_only(true));
    auto sd = fsdp::state_dict(*model);
    if (pg.rank() == 0) fsdp::save_full_state_dict(sd, out);
  }
  const auto osd = fsdp::full_optim_state_dict(*model, opt);  // rank 0 holds it
  if (pg.rank() == 0) fsdp::save_optim_state_dict(osd, out + ".optim");
}

int run(int argc, char** argv) {
  if (argc < 4 || argc > 6) {
    std::cerr << "usage: dcp_interop continue|save DIR OUT.pt [STEPS] [bf16]\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2], out = argv[3];
  const int steps = argc > 4 ? std::atoi(argv[4]) : 1;
  const at::ScalarType dtype = argc > 5 && std::string(argv[5]) == "bf16" ? at::kBFloat16 : at::kFloat;
  auto pg = fsdp::comm::init_process_group(fsdp::comm::InitOptions());
  torch::manual_seed(42);
  auto net = torch::nn::Sequential(torch::nn::Linear(17, 13), torch::nn::ReLU(), torch::nn::Linear(13, 5));
  net->to(dtype);
  Model model(net, pg, fsdp::Options().auto_wrap_policy(fsdp::always_wrap_policy()));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  if (mode == "continue") {
    fsdp::load_dcp(*model, &opt, dir);
    adam_steps(model, opt, steps, dtype);
  } else {
    adam_steps(model, opt, steps, dtype);
    fsdp::save_dcp(*model, &opt, dir);
  }
  save_full(model, opt, pg, out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    fsdp::tools::print_exception("dcp_interop", e);
    return 1;
  }
}
