#pragma once
/// Where this process sits in a job, read from the launcher's environment.
///
/// Launchers and the variables they set:
///   torchrun / fsdp-run : RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
///                         (+ TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT)
///   Slurm (srun)        : SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_JOB_NODELIST
///                         (no MASTER_ADDR: first host of the node list); local world size:
///                         this node's (SLURM_NODEID) entry of SLURM_STEP_TASKS_PER_NODE or
///                         SLURM_TASKS_PER_NODE ("2(x3),1"), else SLURM_NTASKS_PER_NODE
///   OpenMPI (mpirun)    : OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE
///                         OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE
///                         (no MASTER_ADDR: it must be set by the user)
/// torchrun's variables win when several launchers' variables are present (torchrun
/// may itself run inside a Slurm allocation). Explicit values override all of them.

#include <functional>
#include <map>
#include <optional>
#include <string>

namespace fsdp::comm {

/// Which launcher's variables described this process.
enum class LaunchSource {
  kExplicit,
  kTorchrun,
  kSlurm,
  kOpenMpi,
  kSingleProcess,
  Explicit [[deprecated("use kExplicit")]] = kExplicit,
  Torchrun [[deprecated("use kTorchrun")]] = kTorchrun,
  Slurm [[deprecated("use kSlurm")]] = kSlurm,
  OpenMPI [[deprecated("use kOpenMpi")]] = kOpenMpi,
  SingleProcess [[deprecated("use kSingleProcess")]] = kSingleProcess,
};
const char* to_string(LaunchSource s);

struct LaunchEnv {
  LaunchSource source = LaunchSource::kSingleProcess;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// torchrun's agent already serves the store on MASTER_PORT; every rank is a client.
  bool use_agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT: key prefix "/worker/attempt_<n>" keeps restarts apart.
  int restart_count = 0;
};

/// Values given in code; each one set overrides the environment.
struct LaunchOverrides {
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<int> local_rank;
  std::optional<int> local_world_size;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
};

/// Reads variables through `getenv` (injectable for tests). Throws c10::Error
/// naming the variable to set when the environment is incomplete or malformed.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
LaunchEnv parse_launch_env(const EnvLookup& getenv, const LaunchOverrides& overrides = {});
/// The process environment.
EnvLookup process_env();
/// Convenience for tests: a lookup backed by a map.
EnvLookup map_env(std::map<std::string, std::string> vars);

/// First host of a Slurm node list: "node[003-005,9],gpu1" -> "node003".
std::string slurm_first_host(const std::string& nodelist);

}  // namespace fsdp::comm
