#pragma once
// Multi-rank test harness.
//
// A TEST body calls run_ranks(N, body). In the test process this re-executes the
// test binary N times (filtered to this one test) as rank workers that meet over a
// FileStore in a fresh temp directory, waits for all of them under a deadline, kills
// them all when one fails or the deadline passes, and reports each rank's output and
// exit status. In a worker, run_ranks builds the process group and calls body(pg)
// once; gtest assertions inside it fail that worker and so the test. A skip is decided in the
// test process, before run_ranks (FSDP_SKIP_WITHOUT_GPU, which this header brings with
// harness/gpu.h, or GTEST_SKIP): a skip inside the body fails the test, naming the rank.
//
// Start processes once per world size and run many cases inside one body (see
// run_cases): a spawn costs ~1 s of process start and torch initialisation.
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/comm/process_group.h"
#include "harness/gpu.h"

namespace fsdp::testing {

struct RankOptions {
  std::chrono::seconds deadline{240};              ///< whole run, all ranks
  std::chrono::milliseconds collective_timeout{60000};
  int threads_per_rank = 1;                        ///< at::set_num_threads in each worker
  std::vector<std::string> extra_env;              ///< "K=V" for every worker, replacing this process's K
  comm::Backend backend = comm::Backend::kAuto;     ///< what moves CUDA tensors
};

void run_ranks(int world_size, const std::function<void(comm::ProcessGroup&)>& body,
               const RankOptions& options = {});

/// True inside a rank worker process.
bool is_worker();
/// Inside a rank worker: the InitOptions its world was made with (store, rank, timeout,
/// backend), for a test that makes a second world over the same store (with a store_prefix
/// of its own).
comm::InitOptions worker_init_options();
/// Inside a rank worker: the directory of the current run_ranks call (it holds the
/// store and the ranks' logs), shared by its ranks, for files a test does not keep
/// (trace files). The launcher removes it after every rank has exited.
std::string worker_scratch_dir();
/// Inside a rank worker: ends this process at once with status 0, as a rank that
/// dies would (no destructors, no goodbye to its peers), and counts as having run
/// the body. For tests of how the other ranks notice a dead peer.
[[noreturn]] void exit_worker_now();
/// Called from main(): in workers, pins threads and narrows the gtest filter.
void configure_worker_process();

/// Runs named cases one after another inside a worker; a failing case is reported
/// with its name (SCOPED_TRACE) and does not stop the others.
void run_case(const std::string& name, const std::function<void()>& body);

}  // namespace fsdp::testing
