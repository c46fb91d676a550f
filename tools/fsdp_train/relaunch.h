#pragma once
/// Self-launch: `fsdp-train` typed at a shell has no launcher around it, so it replaces
/// itself (execv) with `fsdp-run --nproc N -- <itself> <same args>`, using the fsdp-run that
/// sits in the same directory as this executable. Each rank then sees fsdp-run's
/// torchrun-style environment and joins the job; the exit status is fsdp-run's.

#include <string>

namespace fsdp::train {

/// True if a launcher fsdp::comm understands set this process's placement:
/// RANK/WORLD_SIZE (torchrun, fsdp-run), SLURM_PROCID (srun) or OMPI_COMM_WORLD_RANK (mpirun).
bool under_launcher();

/// execv's fsdp-run; returns only on failure, with the message saying what to do.
std::string relaunch_under_fsdp_run(int nproc, int argc, char** argv);

}  // namespace fsdp::train
