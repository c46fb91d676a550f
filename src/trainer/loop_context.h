#pragma once
// Internal to src/trainer: what every phase of run_training_loop reads, the call's
// arguments in one place (see training_loop.h for their contract).
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/comm/process_group.h"
#include "fsdp/trainer/callback.h"
#include "fsdp/trainer/progress.h"
#include "fsdp/trainer/trainer_options.h"
#include "fsdp/trainer/training_loop.h"

namespace fsdp::trainer::detail {

/// What the loop times steps, validations and checkpoints with.
using LoopClock = std::chrono::steady_clock;

/// Rank 0's word about files it changes (a checkpoint deleted, metrics appended to): said
/// through the progress display when there is one, on stderr otherwise, never dropped.
inline void say_on_lead(bool lead, Progress& progress, bool progress_on, const std::string& line) {
  if (!lead) return;
  if (progress_on) progress.note(line.c_str());
  else std::fprintf(stderr, "%s\n", line.c_str());
}

struct LoopContext {
  const TrainerOptions& options;
  const comm::ProcessGroup& pg;
  const LoopModel& model;
  const LoopData& data;
  const std::vector<std::shared_ptr<Callback>>& callbacks;
  const LoopNames& names;

  int rank() const { return pg.rank(); }
  int world() const { return pg.size(); }
  /// Rank 0 writes the metrics file, the progress and the messages.
  bool lead() const { return pg.rank() == 0; }
  /// What the loop's messages start with (LoopNames::program).
  const char* program() const { return names.program.c_str(); }
  /// How they name the resume setting (LoopNames::resume).
  const char* resume_setting() const { return names.resume.c_str(); }
};

}  // namespace fsdp::trainer::detail
