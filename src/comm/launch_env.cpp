#include "fsdp/comm/launch_env.h"

#include <cstdlib>
#include <sstream>

#include <c10/util/Exception.h>

namespace fsdp::comm {

const char* to_string(LaunchSource s) {
  switch (s) {
    case LaunchSource::kExplicit: return "explicit arguments";
    case LaunchSource::kTorchrun: return "torchrun/fsdp-run";
    case LaunchSource::kSlurm: return "Slurm";
    case LaunchSource::kOpenMpi: return "OpenMPI";
    case LaunchSource::kSingleProcess: return "single process";
  }
  return "?";
}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

EnvLookup map_env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

namespace {

int parse_int(const std::string& name, const std::string& value, const char* source) {
  size_t used = 0;
  long v = 0;
  try {
    v = std::stol(value, &used);
  } catch (...) {
    used = 0;
  }
  TORCH_CHECK(used == value.size() && !value.empty(), "fsdp: environment variable ", name, "='",
              value, "' (set by ", source, ") is not an integer");
  return static_cast<int>(v);
}

std::optional<int> get_int(const EnvLookup& env, const std::string& name, const char* source) {
  auto v = env(name);
  if (!v) return std::nullopt;
  return parse_int(name, *v, source);
}

int require_int(const EnvLookup& env, const std::string& name, const char* source) {
  auto v = get_int(env, name, source);
  TORCH_CHECK(v.has_value(), "fsdp: ", source, " environment detected but ", name,
              " is not set; set it or pass it explicitly to init_process_group");
  return *v;
}

bool truthy(const std::optional<std::string>& v) {
  if (!v) return false;
  return *v == "1" || *v == "True" || *v == "true" || *v == "TRUE" || *v == "yes";
}

// Tasks on this rank's node. srun sets SLURM_STEP_TASKS_PER_NODE (this step) and
// SLURM_TASKS_PER_NODE (the allocation) as one count per node in node order, runs compressed:
// "4" or "2(x3),1" (nodes 0-2 run 2 tasks, node 3 runs 1), and SLURM_NODEID, this node's index.
// A job whose nodes run different numbers of tasks needs the entry of this node, not the
// first: LOCAL_WORLD_SIZE sizes the shared-memory groups and HYBRID_SHARD's default shard group.
// SLURM_NTASKS_PER_NODE (set only with --ntasks-per-node) is the same count for every node.
std::optional<int> slurm_tasks_on_this_node(const EnvLookup& env) {
  const char* src = "Slurm";
  const int node = get_int(env, "SLURM_NODEID", src).value_or(0);
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    auto v = env(name);
    if (!v || v->empty()) continue;
    int first_node = 0;  // of the current run
    std::stringstream runs(*v);
    std::string run;
    while (std::getline(runs, run, ',')) {
      // "C" or "C(xR)"
      const size_t paren = run.find('(');
      const int count = parse_int(name, run.substr(0, paren), src);
      int repeat = 1;
      if (paren != std::string::npos) {
        TORCH_CHECK(run.size() > paren + 3 && run.compare(paren, 2, "(x") == 0 && run.back() == ')',
                    "fsdp: cannot read ", name, "='", *v, "' (expected counts like '2(x3),1')");
        repeat = parse_int(name, run.substr(paren + 2, run.size() - paren - 3), src);
      }
      if (node < first_node + repeat) return count;
      first_node += repeat;
    }
    TORCH_CHECK(false, "fsdp: SLURM_NODEID=", node, " but ", name, "='", *v, "' lists only ",
                first_node, " nodes; launch with srun, which sets both, or with torchrun-style "
                "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE");
  }
  return get_int(env, "SLURM_NTASKS_PER_NODE", src);
}

}  // namespace

std::string slurm_first_host(const std::string& nodelist) {
  // Grammar: host[,host...] where host = prefix[ranges]suffix and ranges =
  // a[-b][,c[-d]...]. Only the first host is needed; zero padding is kept
  // ("node[003-005]" -> "node003").
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') depth++;
    if (c == ']') depth--;
    if (c == ',' && depth == 0) break;
    first.push_back(c);
  }
  auto open = first.find('[');
  if (open == std::string::npos) return first;
  auto close = first.find(']', open);
  TORCH_CHECK(close != std::string::npos, "fsdp: malformed SLURM_JOB_NODELIST '", nodelist,
              "'; set MASTER_ADDR to the first node's address");
  std::string ranges = first.substr(open + 1, close - open - 1);
  std::string lo = ranges.substr(0, ranges.find_first_of(",-"));
  return first.substr(0, open) + lo + first.substr(close + 1);
}

namespace {

// The variables of each launcher (see launch_env.h). Each names the launcher in its errors.
LaunchEnv from_torchrun(const EnvLookup& env, const LaunchOverrides& ov) {
  LaunchEnv out;
  const char* src = "torchrun";
  out.source = LaunchSource::kTorchrun;
  out.rank = require_int(env, "RANK", src);
  out.world_size = require_int(env, "WORLD_SIZE", src);
  out.local_rank = get_int(env, "LOCAL_RANK", src).value_or(out.rank);
  out.local_world_size = get_int(env, "LOCAL_WORLD_SIZE", src).value_or(out.world_size);
  auto addr = env("MASTER_ADDR");
  TORCH_CHECK(addr.has_value() || ov.master_addr.has_value(),
              "fsdp: RANK/WORLD_SIZE are set (torchrun-style launch) but MASTER_ADDR is not; "
              "set MASTER_ADDR (and MASTER_PORT) to rank 0's address");
  if (addr) out.master_addr = *addr;
  auto port = get_int(env, "MASTER_PORT", src);
  TORCH_CHECK(port.has_value() || ov.master_port.has_value(),
              "fsdp: RANK/WORLD_SIZE are set but MASTER_PORT is not; set MASTER_PORT");
  if (port) out.master_port = *port;
  out.use_agent_store = truthy(env("TORCHELASTIC_USE_AGENT_STORE"));
  out.restart_count = get_int(env, "TORCHELASTIC_RESTART_COUNT", src).value_or(0);
  return out;
}

LaunchEnv from_slurm(const EnvLookup& env, const LaunchOverrides& ov) {
  LaunchEnv out;
  const char* src = "Slurm";
  out.source = LaunchSource::kSlurm;
  out.rank = require_int(env, "SLURM_PROCID", src);
  out.world_size = require_int(env, "SLURM_NTASKS", src);
  out.local_rank = get_int(env, "SLURM_LOCALID", src).value_or(0);
  out.local_world_size = slurm_tasks_on_this_node(env).value_or(out.world_size);
  if (auto addr = env("MASTER_ADDR")) {
    out.master_addr = *addr;
  } else if (auto nodes = env("SLURM_JOB_NODELIST")) {
    out.master_addr = slurm_first_host(*nodes);
  } else if (auto nodes2 = env("SLURM_NODELIST")) {
    out.master_addr = slurm_first_host(*nodes2);
  } else {
    TORCH_CHECK(ov.master_addr.has_value(),
                "fsdp: Slurm launch without MASTER_ADDR or SLURM_JOB_NODELIST; set MASTER_ADDR "
                "to the address of the node running SLURM_PROCID=0");
  }
  out.master_port = get_int(env, "MASTER_PORT", src).value_or(29500);
  return out;
}

LaunchEnv from_openmpi(const EnvLookup& env, const LaunchOverrides& ov) {
  LaunchEnv out;
  const char* src = "OpenMPI";
  out.source = LaunchSource::kOpenMpi;
  out.rank = require_int(env, "OMPI_COMM_WORLD_RANK", src);
  out.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", src);
  out.local_rank = get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", src).value_or(0);
  out.local_world_size = get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", src).value_or(out.world_size);
  auto addr = env("MASTER_ADDR");
  if (addr) {
    out.master_addr = *addr;
  } else if (out.world_size == out.local_world_size) {
    // Every rank is on this node: loopback is the right answer.
    out.master_addr = "127.0.0.1";
  } else {
    TORCH_CHECK(ov.master_addr.has_value(),
                "fsdp: OpenMPI launch across nodes sets no rendezvous address; set MASTER_ADDR "
                "to the address of the node running OMPI_COMM_WORLD_RANK=0 (e.g. mpirun -x "
                "MASTER_ADDR=host0 -x MASTER_PORT=29500 ...)");
  }
  out.master_port = get_int(env, "MASTER_PORT", src).value_or(29500);
  return out;
}

// Values given in code win over the environment. `launched`: some launcher's variables
// described this process; without them, the local rank and size follow the explicit ones.
void apply_overrides(LaunchEnv& out, const LaunchOverrides& ov, bool launched) {
  const bool any_override = ov.rank || ov.world_size;
  if (ov.rank) out.rank = *ov.rank;
  if (ov.world_size) out.world_size = *ov.world_size;
  if (ov.local_rank) out.local_rank = *ov.local_rank;
  if (ov.local_world_size) out.local_world_size = *ov.local_world_size;
  if (ov.master_addr) out.master_addr = *ov.master_addr;
  if (ov.master_port) out.master_port = *ov.master_port;
  if (any_override) {
    out.source = LaunchSource::kExplicit;
    if (!ov.local_rank && !launched) out.local_rank = out.rank;
    if (!ov.local_world_size && !launched) out.local_world_size = out.world_size;
  }
}

void check_launch_env(const LaunchEnv& out) {
  TORCH_CHECK(out.world_size >= 1, "fsdp: world size must be >= 1, got ", out.world_size,
              " (from ", to_string(out.source), ")");
  TORCH_CHECK(out.rank >= 0 && out.rank < out.world_size, "fsdp: rank ", out.rank,
              " is outside [0, ", out.world_size, ") (from ", to_string(out.source), ")");
  TORCH_CHECK(out.local_rank >= 0 && out.local_rank < out.local_world_size, "fsdp: local rank ",
              out.local_rank, " is outside [0, ", out.local_world_size, ") (from ",
              to_string(out.source), ")");
  TORCH_CHECK(out.master_port > 0 && out.master_port < 65536, "fsdp: MASTER_PORT ",
              out.master_port, " is not a valid TCP port");
}

}  // namespace

LaunchEnv parse_launch_env(const EnvLookup& env, const LaunchOverrides& ov) {
  const bool torchrun = env("RANK").has_value() && env("WORLD_SIZE").has_value();
  const bool slurm = env("SLURM_PROCID").has_value() && env("SLURM_NTASKS").has_value();
  const bool ompi = env("OMPI_COMM_WORLD_RANK").has_value();
  LaunchEnv out;
  if (torchrun) {
    out = from_torchrun(env, ov);
  } else if (slurm) {
    out = from_slurm(env, ov);
  } else if (ompi) {
    out = from_openmpi(env, ov);
  }
  apply_overrides(out, ov, torchrun || slurm || ompi);
  check_launch_env(out);
  return out;
}

}  // namespace fsdp::comm
