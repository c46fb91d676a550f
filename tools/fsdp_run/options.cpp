#include "options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <optional>

namespace fsdp::launcher {

const char* usage_text() {
  return R"(usage: fsdp-run [--nproc N] [--master-addr ADDR] [--master-port PORT]
                [--nnodes M --node-rank R] [--max-restarts K] [--grace-seconds S]
                -- COMMAND [ARGS...]

Starts N local ranks of COMMAND with the environment torchrun gives (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, ...). Rank 0 serves the store on MASTER_PORT
(TORCHELASTIC_USE_AGENT_STORE=False), except with --max-restarts: then node 0's fsdp-run
serves it for the whole job and every rank is a client (TORCHELASTIC_USE_AGENT_STORE=True,
keys under /worker/attempt_<TORCHELASTIC_RESTART_COUNT>), as under torchrun's agent.

Multi-node: run fsdp-run once per machine with the same --nnodes, --nproc, --master-addr
and --master-port, and --node-rank 0..M-1. Global ranks are node_rank * N + local_rank.
The launchers meet on MASTER_PORT+1 of node 0 (which must be free), check that they agree
on M, N and --max-restarts and that no node rank is taken twice, and stay connected: when
a rank fails or a launcher dies on one node, every node stops its ranks and exits non-zero
(or, with --max-restarts, all nodes start their ranks again together; a node whose
launcher is gone ends the job).

Each output line of rank N is prefixed with "[rankN]: " on the stream it was written to.
If a rank exits non-zero or dies by a signal, the other ranks are stopped (SIGTERM, then
SIGKILL after the grace period) and fsdp-run exits with that rank's exit code (128+signal
for a signal). SIGINT, SIGTERM and SIGHUP are forwarded to all ranks; a second one, or the
end of the grace period, sends SIGKILL.

options:
  --nproc N            ranks to start on this node (default 1; alias --nproc-per-node)
  --nnodes M           number of nodes (default 1; a range MIN:MAX is not supported)
  --node-rank R        this node's index in 0..M-1 (default 0)
  --master-addr ADDR   MASTER_ADDR given to the ranks: node 0's address (default 127.0.0.1)
  --master-port PORT   MASTER_PORT given to the ranks (default or 0: a free ephemeral port;
                       required with --nnodes > 1)
  --rdzv-timeout S     multi-node: seconds the launchers wait for each other (default 300)
  --grace-seconds S    seconds between the stop signal and SIGKILL (default 3)
  --max-restarts N     when a rank fails, stop all ranks (on every node) and start them all
                       again, up to N times, with TORCHELASTIC_RESTART_COUNT = 1, 2, ...
                       (default 0; the same on every node). The nodes restart together once
                       every node's ranks have ended; a node whose launcher is gone ends the
                       job. The program resumes itself, e.g. fsdp-train --resume auto
  --version            print fsdp-run's version and build id (a program that re-executes
                       itself under fsdp-run, fsdp::trainer::Trainer::fit, checks it)
  -h, --help           show this text
Underscore spellings (--nproc_per_node, --node_rank, --master_addr, ...) are accepted.

exit codes: the first failing rank's code (128+signal if killed), 2 for a usage error,
126/127 if COMMAND cannot be executed, 128+signal if fsdp-run itself was signalled, 1 if
another node failed or the launchers could not meet.

example:
  fsdp-run --nproc 2 -- ./build/bin/fsdp-train --config cfg.toml
  fsdp-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc 2 -- ./train
)";
}

// Set by tools/CMakeLists.txt for this file: the same values the library's launch.cpp sees.
#ifndef FSDP_VERSION
#define FSDP_VERSION "unknown"
#endif
#ifndef FSDP_BUILD_ID
#define FSDP_BUILD_ID "unknown"
#endif

const char* version_text() { return "fsdp-run " FSDP_VERSION " (build " FSDP_BUILD_ID ")\n"; }

namespace {

std::optional<long> parse_long(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || end == nullptr || *end != '\0') return std::nullopt;
  return value;
}

std::optional<double> parse_double(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (errno != 0 || end == nullptr || *end != '\0' || !std::isfinite(value)) return std::nullopt;
  return value;
}

ParseResult usage_error(std::string message) {
  ParseResult result;
  result.outcome = ParseOutcome::UsageError;
  result.error = std::move(message);
  return result;
}

}  // namespace

ParseResult parse_command_line(int argc, const char* const* argv) {
  ParseResult result;
  LaunchOptions& options = result.options;
  int i = 1;
  bool saw_separator = false;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      saw_separator = true;
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      result.outcome = ParseOutcome::Help;
      return result;
    }
    if (arg == "--version") {
      result.outcome = ParseOutcome::Version;
      return result;
    }
    // Accept both "--flag value" and "--flag=value".
    std::string name = arg;
    std::optional<std::string> value;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    // torchrun spells its options with underscores; both spellings mean the same.
    if (name.rfind("--", 0) == 0) std::replace(name.begin() + 2, name.end(), '_', '-');
    const bool known = name == "--nproc" || name == "--nproc-per-node" || name == "--nnodes" ||
                       name == "--node-rank" || name == "--master-addr" ||
                       name == "--master-port" || name == "--grace-seconds" ||
                       name == "--rdzv-timeout" || name == "--max-restarts";
    if (!known) {
      if (arg.rfind("-", 0) == 0) {
        return usage_error("unknown option '" + arg + "' (see fsdp-run --help)");
      }
      return usage_error("unexpected argument '" + arg +
                         "': put '--' before the command, e.g. fsdp-run --nproc 2 -- " + arg);
    }
    if (!value) {
      if (i + 1 >= argc) return usage_error("option '" + name + "' needs a value");
      value = argv[++i];
    }
    if (name == "--nnodes") {
      if (value->find(':') != std::string::npos) {
        return usage_error("--nnodes " + *value + ": elastic node counts (MIN:MAX) are not "
                           "supported; give the exact number of nodes, e.g. --nnodes 2");
      }
      auto n = parse_long(*value);
      if (!n || *n < 1 || *n > 4096) {
        return usage_error("--nnodes expects a number of nodes in 1..4096, got '" + *value + "'");
      }
      options.nnodes = static_cast<int>(*n);
    } else if (name == "--node-rank") {
      auto n = parse_long(*value);
      if (!n || *n < 0) {
        return usage_error("--node-rank expects a node index >= 0, got '" + *value + "'");
      }
      options.node_rank = static_cast<int>(*n);
    } else if (name == "--max-restarts") {
      auto n = parse_long(*value);
      if (!n || *n < 0 || *n > 1000) {
        return usage_error("--max-restarts expects a count in 0..1000, got '" + *value + "'");
      }
      options.max_restarts = static_cast<int>(*n);
    } else if (name == "--rdzv-timeout") {
      auto seconds = parse_double(*value);
      if (!seconds || *seconds <= 0 || *seconds > 1e6) {
        return usage_error("--rdzv-timeout expects seconds in (0, 1000000], got '" + *value + "'");
      }
      options.rdzv_timeout_seconds = *seconds;
    } else if (name == "--nproc" || name == "--nproc-per-node") {
      auto n = parse_long(*value);
      if (!n) return usage_error(name + " expects a whole number of ranks, got '" + *value + "'");
      if (*n < 1) {
        return usage_error(name + " must be at least 1, got " + std::to_string(*n));
      }
      // Each rank costs two pipes and a process; beyond this the user surely mistyped.
      if (*n > 4096) {
        return usage_error(name + " must be at most 4096, got " + std::to_string(*n));
      }
      options.nproc = static_cast<int>(*n);
    } else if (name == "--master-addr") {
      if (value->empty()) return usage_error("--master-addr must not be empty");
      options.master_addr = *value;
    } else if (name == "--master-port") {
      auto port = parse_long(*value);
      if (!port || *port < 0 || *port > 65535) {
        return usage_error("--master-port expects a port in 0..65535 (0: pick a free one), got '" +
                           *value + "'");
      }
      options.master_port = static_cast<int>(*port);
    } else {  // --grace-seconds
      auto seconds = parse_double(*value);
      // The upper bound keeps deadlines far from clock overflow; nobody waits 11 days.
      if (!seconds || *seconds < 0 || *seconds > 1e6) {
        return usage_error("--grace-seconds expects a number of seconds in 0..1000000, got '" +
                           *value + "'");
      }
      options.grace_seconds = *seconds;
    }
  }
  if (options.node_rank >= options.nnodes) {
    return usage_error("--node-rank " + std::to_string(options.node_rank) +
                       " is outside 0.." + std::to_string(options.nnodes - 1) + " (--nnodes " +
                       std::to_string(options.nnodes) + ")");
  }
  if (options.nnodes > 1 && options.master_port == 0) {
    return usage_error("--nnodes " + std::to_string(options.nnodes) +
                       " needs --master-port PORT (the same on every node)");
  }
  if (options.nnodes > 1 && options.master_port == 65535) {
    return usage_error("--master-port 65535 leaves no port for the launchers (they use PORT+1)");
  }
  if (!saw_separator) {
    return usage_error("missing '--' before the command, e.g. fsdp-run --nproc 2 -- ./train");
  }
  for (; i < argc; ++i) options.command.emplace_back(argv[i]);
  if (options.command.empty()) {
    return usage_error("missing command after '--', e.g. fsdp-run --nproc 2 -- ./train");
  }
  result.outcome = ParseOutcome::Run;
  return result;
}

}  // namespace fsdp::launcher
