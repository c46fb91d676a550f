#include "comm/device/placement.h"

#include "fsdp/comm/process_group.h"  // the group's CUDA backend and device

namespace fsdp::comm::detail {

namespace {

void check_cuda_device(const std::string& name, at::Device d, const ProcessGroup& pg, const char* who) {
  TORCH_CHECK(pg.cuda_backend() != Backend::kAuto, who, " (rank ", pg.rank(), "): parameter ", name,
              " is on ", d, ", but this process group moves no CUDA tensors (it was made without a CUDA "
              "backend: a rank of the world has no GPU, or this build has no CUDA). Initialise the group on "
              "GPU ranks (InitOptions::backend NCCL, or Gloo for ranks sharing a GPU), or keep the model on the CPU");
  TORCH_CHECK(d.index() == pg.cuda_device(), who, " (rank ", pg.rank(), "): parameter ", name, " is on ", d,
              ", but this rank is bound to cuda:", pg.cuda_device(), ". Move the model with "
              "model->to(torch::Device(torch::kCUDA, pg.cuda_device())) before wrapping it");
}

}  // namespace

at::Device model_device(const std::vector<std::pair<std::string, at::Tensor>>& params,
                        const ProcessGroup& pg, const char* who) {
  if (params.empty()) return at::kCPU;
  const auto& [first_name, first] = params.front();
  const at::Device device = first.device();
  for (const auto& [name, t] : params)
    TORCH_CHECK(t.device() == device, who, " (rank ", pg.rank(), "): the model's parameters are on more than one "
                "device: ", first_name, " on ", device, ", ", name, " on ", t.device(),
                ". FSDP and ZeRO train one model on one device per rank: move the whole model before wrapping");
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), who, " (rank ", pg.rank(), "): parameter ", first_name,
              " is on ", device, "; FSDP and ZeRO run on CPU and CUDA devices only");
  if (device.is_cuda()) check_cuda_device(first_name, device, pg, who);
  return device;
}

}  // namespace fsdp::comm::detail
