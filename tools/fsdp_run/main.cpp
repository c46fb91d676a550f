// fsdp-run: the project's launcher. Starts N local ranks with torchrun's environment and
// supervises them, one attempt after another under --max-restarts; see `fsdp-run --help`,
// supervisor.h and node_link.h.

#include <cmath>
#include <cstdio>
#include <exception>

#include "agent_store.h"
#include "common/tool_error.h"
#include "node_link.h"
#include "options.h"
#include "rank_env.h"
#include "supervisor.h"

int main(int argc, char** argv) {
  using namespace fsdp::launcher;
  ParseResult parsed = parse_command_line(argc, argv);
  switch (parsed.outcome) {
    case ParseOutcome::Help:
      std::fputs(usage_text(), stdout);
      return 0;
    case ParseOutcome::Version:
      std::fputs(version_text(), stdout);
      return 0;
    case ParseOutcome::UsageError:
      std::fprintf(stderr, "fsdp-run: %s\nTry 'fsdp-run --help' for the options.\n",
                   parsed.error.c_str());
      return 2;
    case ParseOutcome::Run: break;
  }
  const LaunchOptions& options = parsed.options;
  try {
    JobSpec spec;
    spec.command = options.command;
    JobTopology& job = spec.topology;
    job.nproc_per_node = options.nproc;
    job.nnodes = options.nnodes;
    job.node_rank = options.node_rank;
    job.master_addr = options.master_addr;
    job.max_restarts = options.max_restarts;
    spec.grace_seconds = options.grace_seconds;
    // With restarts the store must outlive each attempt: node 0's fsdp-run serves it for the
    // whole job (agent_store.h). Started before the other nodes are let in, so it is up
    // before any rank anywhere connects.
    std::unique_ptr<AgentStore> store;
    job.agent_store = options.max_restarts > 0;
    if (job.agent_store && options.node_rank == 0) {
      store = AgentStore::start(options.master_port);
      job.master_port = store->port();
    } else {
      job.master_port = options.master_port != 0 ? options.master_port : pick_free_port();
    }
    std::unique_ptr<NodeLink> link;
    if (options.nnodes > 1) {
      link = NodeLink::establish(job, options.master_addr, options.master_port + 1,
                                 options.rdzv_timeout_seconds);
    }
    // One attempt after another; with several nodes all of them restart together, on node
    // 0's word ([Note: restart together]).
    for (;;) {
      Supervisor supervisor(spec, link.get());
      const int code = supervisor.run();
      if (!supervisor.restart()) {
        if (!supervisor.no_restart_reason().empty()) {
          std::fprintf(stderr, "fsdp-run: %s\n", supervisor.no_restart_reason().c_str());
        }
        return code;
      }
      ++job.restart_count;
      if (job.nnodes == 1) {
        std::fprintf(stderr, "fsdp-run: restarting all %d ranks (restart %d of %d)\n",
                     job.nproc_per_node, job.restart_count, job.max_restarts);
      } else {
        std::fprintf(stderr,
                     "fsdp-run: restarting all %d ranks of the %d nodes together, %d here "
                     "(restart %d of %d)\n",
                     job.world_size(), job.nnodes, job.nproc_per_node, job.restart_count,
                     job.max_restarts);
      }
      if (link) link->begin_attempt();
    }
  } catch (const LauncherError& e) {
    fsdp::tools::print_exception("fsdp-run", e);
    return 1;
  }
}
