// fsdp-train: the project's main job. Trains an mlp or a cnn on Fashion-MNIST, or a
// byte-level gpt on a text file, with FullyShardedDataParallel and reports accuracy,
// throughput and memory per rank.
//
//   fsdp-train                          # 2 local ranks, FULL_SHARD, Adam, 3 epochs
//   fsdp-train --strategy no_shard --steps 200 --metrics m.jsonl
//   fsdp-train --model gpt --layers 4 --dim 128 --text book.txt
//   fsdp-run --nproc 4 -- fsdp-train    # or torchrun --no_python, srun, mpirun
//
// Order of checks: the command line and the input files are checked before any rank
// starts (so a typo costs no rendezvous); the batch/world-size check is done here too
// when this process will pick the world size itself, and again on every rank otherwise.

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

#include "common/tool_error.h"
#include "estimate.h"
#include "options.h"
#include "relaunch.h"
#include "resume.h"
#include "train.h"

namespace {

int fail(const std::string& message, int status = 2) {
  fsdp::tools::print_error("fsdp-train", message, "error: ");
  return status;
}

// The world size a launcher set, or `fallback` when none did (the size we would start).
int launcher_world_size(int fallback) {
  for (const char* var : {"WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"})
    if (const char* v = std::getenv(var)) return std::atoi(v) > 0 ? std::atoi(v) : fallback;
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fsdp::train;
  ParseResult parsed = parse_command_line(argc, argv);
  if (parsed.outcome == ParseOutcome::Help) {
    std::printf("%s", parsed.message.c_str());
    return 0;
  }
  if (parsed.outcome == ParseOutcome::UsageError) return fail(parsed.message);
  const TrainOptions& o = parsed.options;
  const bool launched = under_launcher();
  const int world = launched ? launcher_world_size(o.nproc) : o.nproc;

  if (o.estimate_memory) {
    const char* rank = std::getenv("RANK");
    if (rank == nullptr || std::string(rank) == "0") {
      print_memory_estimate(stdout, model_num_params(o), world, o.mixed_precision == "bf16");
      print_construction_estimate(stdout, o, world);
    }
    return 0;
  }
  if (std::string e = check_device(o); !e.empty()) return fail(e);
  if (std::string e = check_inputs(o); !e.empty()) return fail(e);
  if (std::string e = check_resume(o); !e.empty()) return fail(e);
  if (std::string e = check_world_size(o, world); !e.empty()) return fail(e);

  if (!launched) return fail(relaunch_under_fsdp_run(o.nproc, argc, argv), 1);

  try {
    return run_rank(o);
  } catch (const c10::Error& e) {
    fsdp::tools::print_exception("fsdp-train", e, "error: ");
    return 1;
  } catch (const std::exception& e) {
    fsdp::tools::print_exception("fsdp-train", e, "error: ");
    return 1;
  }
}
