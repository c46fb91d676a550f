// What the always-on flight recorder (src/comm/flight_recorder.h) costs one collective:
// FlightRecorder::record at issue plus complete at wait, as the choke point and
// CommHandle::wait do them, with a unit label of realistic length, timed over many calls in
// one thread. Multiplied by the collectives of one step (bench_strategies prints them as
// collectives_per_step) and divided by that step's time, it is the recorder's share of a
// step, which is far below what a whole-step A/B on these machines can resolve.
//
//   bench_flight_recorder [--records 2000000] [--step-ms T --collectives-per-step K]
#include <chrono>
#include <cstdio>
#include <string>

#include <torch/torch.h>

#include "comm/collective_call.h"
#include "comm/flight_recorder.h"
#include "common/tool_error.h"

namespace {

struct Args {
  int64_t records = 2000000;
  double step_ms = 0;
  double per_step = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    TORCH_CHECK(i + 1 < argc, "bench_flight_recorder: ", k, " needs a value");
    const std::string v = argv[++i];
    if (k == "--records") a.records = std::stoll(v);
    else if (k == "--step-ms") a.step_ms = std::stod(v);
    else if (k == "--collectives-per-step") a.per_step = std::stod(v);
    else TORCH_CHECK(false, "bench_flight_recorder: unknown option ", k,
                     "; usage: bench_flight_recorder [--records N] [--step-ms T --collectives-per-step K]");
  }
  TORCH_CHECK(a.records > 0, "bench_flight_recorder: --records must be > 0");
  return a;
}

double ns_per_record(int64_t n) {
  namespace comm = fsdp::comm;
  comm::detail::FlightRecorder recorder;
  comm::detail::CollectiveCall call;
  call.op = comm::detail::CollectiveOp::kAllGather;
  call.out = torch::empty({1 << 16});
  call.in = torch::empty({1 << 15});
  call.label = comm::CallLabel(comm::Phase::kForward, "layers.12.attention");
  uint64_t sum = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t seq = recorder.record(call);
    recorder.complete(seq);
    sum += seq;
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  if (sum == 0) std::printf("unreachable\n");  // keeps the loop
  return ns / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    ns_per_record(a.records / 10);  // warm the ring's strings
    const double ns = ns_per_record(a.records);
    std::printf("ns_per_record=%.1f records=%lld\n", ns, static_cast<long long>(a.records));
    if (a.step_ms > 0 && a.per_step > 0) {
      const double share = ns * a.per_step / (a.step_ms * 1e6);
      std::printf("step_ms=%.3f collectives_per_step=%.0f recorder_share_of_step=%.6f\n", a.step_ms, a.per_step, share);
    }
    return 0;
  } catch (const std::exception& e) {
    fsdp::tools::print_exception("bench_flight_recorder", e);
    return 2;
  }
}
