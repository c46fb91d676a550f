#pragma once
/// fsdp-run's command line: what the user asked for, checked completely before any rank starts,
/// so a typo never leaves a half-started job behind.

#include <string>
#include <vector>

namespace fsdp::launcher {

struct LaunchOptions {
  /// Ranks started on this machine (torchrun's --nproc-per-node); the same on every node.
  int nproc = 1;
  /// Machines in the job and this one's index; WORLD_SIZE = nnodes * nproc.
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  /// 0 means "pick a free ephemeral port" (resolved in main, before the ranks start); only
  /// for one node, since every node must be told the same port.
  int master_port = 0;
  /// How long ranks get between the stop signal (SIGTERM, or the forwarded signal) and SIGKILL.
  double grace_seconds = 3.0;
  /// After a rank fails, stop all (every node) and start them again, up to this many times.
  int max_restarts = 0;
  /// Multi-node: how long the launchers wait for each other at the start.
  double rdzv_timeout_seconds = 300.0;
  /// argv of every rank: everything after "--".
  std::vector<std::string> command;
};

enum class ParseOutcome { Run, Help, Version, UsageError };

struct ParseResult {
  ParseOutcome outcome = ParseOutcome::UsageError;
  LaunchOptions options;
  /// For UsageError: what was wrong and how to fix it (one line, no "fsdp-run: " prefix).
  std::string error;
};

ParseResult parse_command_line(int argc, const char* const* argv);

/// The --help text.
const char* usage_text();

/// The --version line, "fsdp-run <project version> (build <build id>)\n": fsdp::Trainer
/// re-executes a program only under the fsdp-run of its own build (trainer/launch.h).
const char* version_text();

}  // namespace fsdp::launcher
