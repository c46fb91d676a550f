// bench_async_checkpoint: what an asynchronous checkpoint (fsdp::save_checkpoint_async) costs,
// against baselines measured in the same run, in rounds that alternate which side goes first:
//
//   writer   save_checkpoint_async + wait() at once (training idle) vs one plain write + fsync
//            stream per rank of as many random bytes as its rank file: ratio = plain seconds /
//            async seconds (goal >= 0.8); CPU seconds per GB of each, all ranks' (goal: the
//            writer's <= 1.1x the stream's)
//   blocked  the training thread's blocked time per save while training runs (the save call,
//            with its wait for the previous save and its snapshot, plus the copy-on-write
//            faults training threads took during the write) vs a blocking save_checkpoint of
//            the same state: ratio = blocked / blocking (goal <= 0.02); the slowest rank's
//
// Model: --layers Linear(D, D) layers, one unit each, FULL_SHARD, Adam: 12 bytes per
// parameter on disk (the parameter and two moments). The first asynchronous save moves the
// state onto pages of its own ([Note: state on pages of its own]); its blocked time is
// printed on its own, outside the rounds.
//
//   bench_async_checkpoint [--nproc 4] [--rounds 5] [--layers 20] [--dim 2048] [--steps 3]
//                          [--warmup 2] [--settle-ms 0] [--dir /tmp]
//
// --warmup rounds run first, untimed: a run's first saves and writes take their page cache from
// memory this VM has not touched yet (several times the CPU of reused memory), and a long
// training run's saves reuse memory. --settle-ms S makes every write start from memory the VM
// has handed back to its host instead ([Note: settle before cold regions] in bench_io.h).
//
// Without RANK in the environment it re-executes itself under fsdp-run (same bin directory).
// Rank 0 prints one JSON line per round and op, then the medians and ranges.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "bench_io.h"
#include "bench_launch.h"
#include "fsdp/comm/collectives.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/checkpoint.h"

using namespace fsdp;
namespace fs = std::filesystem;

namespace {

struct Args {
  int nproc = 4, rounds = 5, layers = 20, dim = 2048, steps = 3, warmup = 2, settle_ms = 0;
  std::string dir = "/tmp";
  std::vector<std::string> argv;  // as given, for the ranks' command line
};

const char* kUsage =
    "usage: bench_async_checkpoint [--nproc 4] [--rounds 5] [--layers 20] [--dim 2048] [--steps 3]\n"
    "                              [--warmup 2] [--settle-ms 0] [--dir /tmp]\n"
    "(what it measures: the comment at the top of bench/bench_async_checkpoint.cpp)\n";

Args parse_args(int argc, char** argv) {
  Args a;
  a.argv.assign(argv + 1, argv + argc);
  bench::parse_flags("bench_async_checkpoint", kUsage, argc, argv,
                     {{"--nproc", &a.nproc, 1}, {"--rounds", &a.rounds, 1}, {"--layers", &a.layers, 1},
                      {"--dim", &a.dim, 1}, {"--steps", &a.steps, 1}, {"--warmup", &a.warmup, 0},
                      {"--settle-ms", &a.settle_ms, 0}},
                     {{"--dir", &a.dir}});
  return a;
}

int launcher_main(const Args& a) { return bench::exec_under_launcher("bench_async_checkpoint", a.nproc, a.argv); }

// ---- ranks --------------------------------------------------------------------------------

struct Trainee {
  torch::nn::Sequential net;
  std::unique_ptr<FullyShardedDataParallel<torch::nn::SequentialImpl>> model;
  std::unique_ptr<torch::optim::Adam> opt;
  int64_t dim = 0;

  void step() {
    opt->zero_grad(/*set_to_none=*/true);
    (*model)->forward(torch::randn({4, dim})).square().mean().backward();
    opt->step();
  }
};

Trainee make_trainee(const Args& a, comm::ProcessGroup& pg) {
  Trainee t;
  t.dim = a.dim;
  torch::manual_seed(0);
  for (int i = 0; i < a.layers; ++i) t.net->push_back(torch::nn::Linear(a.dim, a.dim));
  t.model = std::make_unique<FullyShardedDataParallel<torch::nn::SequentialImpl>>(
      t.net, pg, Options().auto_wrap_policy(always_wrap_policy()));
  t.opt = std::make_unique<torch::optim::Adam>((*t.model)->parameters(), torch::optim::AdamOptions(1e-4));
  t.step();  // Adam state exists
  return t;
}

struct Timed {
  double seconds = 0, cpu = 0;
};

// f between barriers: the wall time until the slowest rank is done, this rank's CPU time.
// Writes first wait for the VM to settle ([Note: settle before cold regions] in bench_io.h):
// each save frees the previous one's page cache, which the VM hands back to its host.
Timed timed(comm::ProcessGroup& pg, const std::function<void()>& f, int64_t settle_ms = 0) {
  comm::barrier(pg);
  if (settle_ms > 0 && pg.rank() == 0) bench::settle(settle_ms);
  comm::barrier(pg);
  const double t0 = bench::now(), c0 = bench::cpu_now();
  f();
  Timed t;
  t.cpu = bench::cpu_now() - c0;
  comm::barrier(pg);
  t.seconds = bench::now() - t0;
  return t;
}

struct Round {
  Timed plain, async_idle, blocking;
  double blocked = 0;  // this rank's save call + faults, while training ran
  int64_t pages_copied = 0;
};

Round run_round(int r, const Args& a, comm::ProcessGroup& pg, Trainee& t, const std::string& dir,
                const at::Tensor& random_bytes) {
  Round out;
  const std::string plain = dir + "/plain_rank" + std::to_string(pg.rank()) + ".bin";
  auto write_plain = [&] {
    out.plain = timed(pg, [&] {
      bench::plain_write(plain, static_cast<const char*>(random_bytes.data_ptr()), random_bytes.numel());
    }, a.settle_ms);
  };
  auto write_async = [&] {
    out.async_idle = timed(pg, [&] { save_checkpoint_async(dir + "/idle", **t.model, t.opt.get()).wait(); },
                           a.settle_ms);
  };
  if (r % 2 == 0) {
    write_plain();
    write_async();
  } else {
    write_async();
    write_plain();
  }
  out.blocking = timed(pg, [&] { save_checkpoint(dir + "/blocking", **t.model, t.opt.get()); }, a.settle_ms);
  comm::barrier(pg);
  CheckpointHandle h = save_checkpoint_async(dir + "/training", **t.model, t.opt.get());
  for (int s = 0; s < a.steps; ++s) t.step();
  h.wait();
  const CheckpointSaveStats st = h.stats();
  out.blocked = st.blocked_s + st.cow_fault_s;
  out.pages_copied = st.cow_pages_copied;
  return out;
}

int64_t my_file_bytes(const std::string& ckpt, int rank) {
  char name[64];
  std::snprintf(name, sizeof(name), "/shard_rank%05d.bin", rank);
  const std::string f = ckpt + name;
  return fs::exists(f) ? static_cast<int64_t>(fs::file_size(f)) : 0;
}

struct Summary {
  std::vector<double> writer, cpu, blocked;
};

// Rank 0: one JSON line per round (all ranks' CPU summed, the slowest rank's blocked time).
void report_round(int r, const Round& x, const at::Tensor& all, double gb, Summary& s) {
  const auto v = all.accessor<double, 1>();  // plain cpu, async cpu, blocked (max), pages (sum), blocking cpu
  const double writer = x.plain.seconds / x.async_idle.seconds, cpu_ratio = v[1] / v[0];
  const double blocked = v[2] / x.blocking.seconds;
  s.writer.push_back(writer);
  s.cpu.push_back(cpu_ratio);
  s.blocked.push_back(blocked);
  std::printf("{\"op\": \"writer\", \"round\": %d, \"gb\": %.3f, \"async_seconds\": %.4f, \"plain_seconds\": %.4f, "
              "\"ratio\": %.3f, \"async_cpu_s_per_gb\": %.4f, \"plain_cpu_s_per_gb\": %.4f, \"cpu_ratio\": %.3f}\n",
              r, gb, x.async_idle.seconds, x.plain.seconds, writer, v[1] / gb, v[0] / gb, cpu_ratio);
  std::printf("{\"op\": \"blocked\", \"round\": %d, \"blocked_seconds\": %.5f, \"blocking_save_seconds\": %.4f, "
              "\"ratio\": %.4f, \"cow_pages_copied\": %.0f, \"blocking_save_cpu_s_per_gb\": %.4f}\n",
              r, v[2], x.blocking.seconds, blocked, v[3], v[4] / gb);
  std::fflush(stdout);
}

void report_summary(const Summary& s, int rounds) {
  auto row = [&](const char* what, const std::vector<double>& v, const char* goal) {
    std::printf("%-44s median %.4f (%.4f-%.4f), %d rounds; goal %s\n", what, bench::median(v),
                *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()), rounds, goal);
  };
  row("writer, training idle / plain write+fsync", s.writer, ">= 0.8");
  row("writer CPU-s per GB / plain stream's", s.cpu, "<= 1.1");
  row("blocked per save / blocking save", s.blocked, "<= 0.02");
}

int rank_main(const Args& a) {
  auto pg = comm::init_process_group(comm::InitOptions());
  const int rank = pg.rank();
  const std::string dir = a.dir + "/bench_async_checkpoint";
  if (rank == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  Trainee t = make_trainee(a, pg);
  // The first asynchronous save also moves the state onto pages of its own.
  const Timed first = timed(pg, [&] { save_checkpoint_async(dir + "/idle", **t.model, t.opt.get()).wait(); });
  const int64_t my_bytes = my_file_bytes(dir + "/idle", rank);
  const at::Tensor random_bytes = torch::randint(0, 256, {std::max<int64_t>(my_bytes, 1)}, torch::kByte);
  auto total = torch::tensor({double(my_bytes)}, torch::kDouble);
  comm::all_reduce(pg, total).wait();
  const double gb = total.item<double>() / 1e9;
  if (rank == 0)
    std::printf("bench_async_checkpoint: %d ranks, %d layers of %dx%d, FULL_SHARD, Adam; %.3f GB per save; the first "
                "asynchronous save (moving the state onto its own pages) took %.3f s\n",
                pg.size(), a.layers, a.dim, a.dim, gb, first.seconds);
  for (int r = 0; r < a.warmup; ++r) run_round(r, a, pg, t, dir, random_bytes);
  Summary s;
  for (int r = 0; r < a.rounds; ++r) {
    const Round x = run_round(r, a, pg, t, dir, random_bytes);
    auto all = torch::tensor({x.plain.cpu, x.async_idle.cpu, 0.0, double(x.pages_copied), x.blocking.cpu},
                             torch::kDouble);
    comm::all_reduce(pg, all).wait();
    auto slowest = torch::tensor({x.blocked}, torch::kDouble);
    comm::all_reduce(pg, slowest, comm::ReduceOp::kMax).wait();
    all[2] = slowest[0];
    if (rank == 0) report_round(r, x, all, gb, s);
  }
  if (rank == 0) report_summary(s, a.rounds);
  comm::barrier(pg);
  if (rank == 0) fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::bench::launcher_or_rank_main("bench_async_checkpoint", parse_args(argc, argv), launcher_main,
                                           rank_main);
}
