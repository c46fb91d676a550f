// fsdp-run: the project's launcher. Starts N local ranks with torchrun's standalone
// environment and supervises them; see `fsdp-run --help` and supervisor.h.

#include <cmath>
#include <cstdio>
#include <exception>

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
    spec.topology.nproc_per_node = options.nproc;
    spec.topology.nnodes = options.nnodes;
    spec.topology.node_rank = options.node_rank;
    spec.topology.master_addr = options.master_addr;
    spec.topology.master_port =
        options.master_port != 0 ? options.master_port : pick_free_port();
    spec.grace_seconds = options.grace_seconds;
    std::unique_ptr<NodeLink> link;
    if (options.nnodes > 1) {
      link = NodeLink::establish(spec.topology, options.master_addr, options.master_port + 1,
                                 options.rdzv_timeout_seconds);
    }
    spec.topology.max_restarts = options.max_restarts;
    // --max-restarts: a failed attempt is followed by a fresh one with the next restart count;
    // fsdp-run's own stop signal ends the job at once.
    for (int attempt = 0;; ++attempt) {
      spec.topology.restart_count = attempt;
      Supervisor supervisor(spec, attempt == 0 ? std::move(link) : nullptr);
      const int code = supervisor.run();
      if (code == 0 || supervisor.stopped_by_signal() || attempt >= options.max_restarts) return code;
      std::fprintf(stderr, "fsdp-run: restarting all %d ranks (restart %d of %d)\n",
                   spec.topology.nproc_per_node, attempt + 1, options.max_restarts);
    }
  } catch (const LauncherError& e) {
    fsdp::tools::print_exception("fsdp-run", e);
    return 1;
  }
}
