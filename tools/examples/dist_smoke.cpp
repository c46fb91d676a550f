// dist_smoke: checks that a launcher's environment turns into a working process group.
//
// Run it under any launcher fsdp::comm understands (fsdp-run, torchrun, mpirun, srun, or
// bare processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT). Each rank bootstraps the
// world group from its environment, runs three collectives whose results can be checked
// by hand, and prints one line:
//
//   dist_smoke rank=R world=W local_rank=L source=<launcher> agent_store=0|1 allreduce=W ok
//
// The values (chunk = 4 elements, W ranks):
//   all_reduce      ones(4) summed over ranks             -> every element == W
//   all_gather_into rank r contributes full(chunk, r + 1)  -> flat[r*chunk + k] == r + 1
//   reduce_scatter  rank q holds flat[i] = i + q           -> out[k] on rank r ==
//                                                             W*(r*chunk + k) + W(W-1)/2
// All values are small integers, exact in fp32. A wrong value prints what was expected and
// what was seen, and exits 1.
//
// Fail-fast testing: `--fail-rank K` makes rank K exit(3) right after the rendezvous (after a
// barrier, so every rank has finished init_process_group); the others then run the
// collectives and must fail with the library's error ("... failed on rank ...") within
// `--timeout-ms` (default 10000), which is also the process group's timeout. `--hang-rank K`
// makes rank K stay alive but stop calling collectives (a stuck rank): the others must then
// fail by the timeout itself, since no connection closes. `--skip-rank K` makes rank K skip
// the all-gather (a rank that took another path): every rank's error then names the
// divergence from the flight recorder, and fsdp-run prints it once for the job.
// `--wide-rank K` makes rank K contribute twice as many elements to the all-gather (a rank
// whose model is wider), `--extra-rank K` makes it run the all-reduce twice (a rank that
// takes an extra micro-batch). Over Gloo these are meant for the checked mode
// (FSDP_CHECK_COLLECTIVES=1): unchecked, Gloo aborts a rank that receives a message of
// another size inside its own thread.

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "common/tool_error.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/comm/process_group.h"

namespace {

namespace comm = fsdp::comm;

struct Args {
  int fail_rank = -1;
  int hang_rank = -1;
  int skip_rank = -1;
  int wide_rank = -1;
  int extra_rank = -1;
  long timeout_ms = 10000;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr,
               "dist_smoke: %s\nusage: dist_smoke [--fail-rank K | --hang-rank K | --skip-rank K | --wide-rank K | "
               "--extra-rank K] [--timeout-ms MS]\n",
               what.c_str());
  std::exit(2);
}

long parse_long(const std::string& flag, const char* value) {
  if (value == nullptr) usage_error(flag + " needs a value");
  char* end = nullptr;
  long v = std::strtol(value, &end, 10);
  if (end == value || *end != '\0') usage_error(flag + " expects an integer, got '" + value + "'");
  return v;
}

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const char* next = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--fail-rank") {
      args.fail_rank = static_cast<int>(parse_long(a, next));
      ++i;
    } else if (a == "--hang-rank") {
      args.hang_rank = static_cast<int>(parse_long(a, next));
      ++i;
    } else if (a == "--skip-rank") {
      args.skip_rank = static_cast<int>(parse_long(a, next));
      ++i;
    } else if (a == "--wide-rank") {
      args.wide_rank = static_cast<int>(parse_long(a, next));
      ++i;
    } else if (a == "--extra-rank") {
      args.extra_rank = static_cast<int>(parse_long(a, next));
      ++i;
    } else if (a == "--timeout-ms") {
      args.timeout_ms = parse_long(a, next);
      ++i;
      if (args.timeout_ms <= 0) usage_error("--timeout-ms must be positive");
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: dist_smoke [--fail-rank K | --hang-rank K | --skip-rank K | --wide-rank K | --extra-rank K] "
                  "[--timeout-ms MS]\n");
      std::exit(0);
    } else {
      usage_error("unknown argument '" + a + "'");
    }
  }
  return args;
}

// One word per launcher, for grep-able output lines.
const char* source_token(comm::LaunchSource s) {
  switch (s) {
    case comm::LaunchSource::kExplicit: return "explicit";
    case comm::LaunchSource::kTorchrun: return "torchrun";
    case comm::LaunchSource::kSlurm: return "slurm";
    case comm::LaunchSource::kOpenMpi: return "openmpi";
    case comm::LaunchSource::kSingleProcess: return "single";
  }
  return "unknown";
}

// Compares element-wise; on mismatch throws naming the check, the index and both values.
void expect_equal(const char* check, int rank, const at::Tensor& got, const at::Tensor& want) {
  TORCH_CHECK(got.sizes() == want.sizes(), "dist_smoke: ", check, " on rank ", rank,
              ": shape ", got.sizes(), ", expected ", want.sizes());
  auto g = got.contiguous();
  auto w = want.contiguous();
  const float* gp = g.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  for (int64_t i = 0; i < g.numel(); ++i) {
    TORCH_CHECK(gp[i] == wp[i], "dist_smoke: ", check, " on rank ", rank, ": element ", i,
                " is ", gp[i], ", expected ", wp[i]);
  }
}

// Before the group exists (a failed rendezvous) the rank is not known yet.
std::string rank_label(int rank) { return rank >= 0 ? std::to_string(rank) : "?"; }

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  // Gloo's TCP transport writes with writev(), so a rank that sends to a peer which just
  // died can be killed by SIGPIPE (exit 141, no message) before the library sees the error;
  // measured: 2 of 40 fail-fast runs on a loaded 2-core machine. Python ignores SIGPIPE, so
  // torch.distributed users never see this. fsdp::comm does not (yet) ignore it itself, so
  // this program does, as every C++ program using fsdp::comm should for now.
  std::signal(SIGPIPE, SIG_IGN);
  int rank = -1;
  try {
    auto pg = comm::init_process_group(
        comm::InitOptions().timeout(std::chrono::milliseconds(args.timeout_ms)));
    rank = pg.rank();
    const int world = pg.size();

    if (args.fail_rank >= 0 || args.hang_rank >= 0) {
      const int target = std::max(args.fail_rank, args.hang_rank);
      TORCH_CHECK(target < world, "dist_smoke: rank ", target, " of --fail-rank/--hang-rank is "
                  "outside the world of ", world, " ranks");
      comm::barrier(pg);  // everyone is past init_process_group
      if (rank == args.fail_rank) {
        std::fprintf(stderr, "dist_smoke rank=%d: exiting with code 3 as asked (--fail-rank)\n",
                     rank);
        std::fflush(nullptr);
        std::_Exit(3);  // no destructors: behave like a crashed rank
      }
      if (rank == args.hang_rank) {
        std::fprintf(stderr, "dist_smoke rank=%d: hanging as asked (--hang-rank)\n", rank);
        std::fflush(nullptr);
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // alive, silent
      }
    }

    const auto opts = at::TensorOptions().dtype(at::kFloat);
    constexpr int64_t chunk = 4;

    auto summed = at::ones({chunk}, opts);
    comm::all_reduce(pg, summed).wait();
    expect_equal("all_reduce of ones", rank, summed, at::full({chunk}, float(world), opts));
    if (rank == args.extra_rank) comm::all_reduce(pg, summed).wait();

    if (rank != args.skip_rank) {
      const int64_t mine = rank == args.wide_rank ? 2 * chunk : chunk;
      auto flat = at::empty({world * mine}, opts);
      auto shard = at::full({mine}, float(rank + 1), opts);
      comm::all_gather_into(pg, flat, shard).wait();
      auto gathered_want = at::arange(1, world + 1, opts).repeat_interleave(chunk);
      expect_equal("all_gather_into", rank, flat, gathered_want);
    }

    auto to_scatter = at::arange(world * chunk, opts) + float(rank);
    auto out = at::empty({chunk}, opts);
    comm::reduce_scatter(pg, out, to_scatter).wait();
    auto scatter_want = at::arange(rank * chunk, (rank + 1) * chunk, opts) * float(world) +
                        float(world * (world - 1) / 2);
    expect_equal("reduce_scatter", rank, out, scatter_want);

    const auto& env = pg.launch_env();
    std::printf("dist_smoke rank=%d world=%d local_rank=%d source=%s agent_store=%d allreduce=%d ok\n",
                rank, world, pg.local_rank(), source_token(env.source),
                env.use_agent_store ? 1 : 0, static_cast<int>(summed[0].item<float>()));
    std::fflush(stdout);
    comm::barrier(pg);  // nobody tears down its Gloo pairs while a peer still uses them
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "dist_smoke rank=%s: FAILED: %s\n", rank_label(rank).c_str(),
                 fsdp::tools::error_text(e).c_str());
    std::fflush(nullptr);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_smoke rank=%s: FAILED: %s\n", rank_label(rank).c_str(), e.what());
    std::fflush(nullptr);
    return 1;
  }
  return 0;
}
