#!/usr/bin/env python3
"""Where a step's time goes, from FSDP's schedule traces (FSDP_TRACE=DIR, docs/usage.md).

For each trace_rank*.json in DIR: the steady steps (from one "forward 0" span to the next,
leaving out the first WARM steps and any step over 3x the median, e.g. a checkpoint or a
warm-up), and per step on average: the wall time, the compute thread's forward and backward
spans, FSDP's phases on that thread (the trace's tid 3: issuing and waiting for gathers and
reductions, flattening gradients, optimizer steps inside backward), and the rest (the
loss, the optimizer's own step and the clearing of gradients, hooks, the autograd engine).

  FSDP_TRACE=/tmp/tr OMP_NUM_THREADS=1 build/bin/fsdp-run --nproc 2 -- build/bin/bench_strategies \\
      --model transformer --strategy full_shard --optim cpuadam --prefetch default --shard-group 0 \\
      --bucket-mb 0 --steps 10 --warmup 3 --optimizer-in-backward
  python3 bench/trace_breakdown.py /tmp/tr [WARM]
"""
import glob
import json
import os
import statistics
import sys

PHASES = ("issue_gather", "wait_gather", "flatten", "issue_reduce", "wait_reduce", "step")


def spans(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]
    xs.sort(key=lambda e: e["ts"])
    return xs


def breakdown(xs, warm):
    starts = [e["ts"] for e in xs if e["name"] == "forward 0"]
    steps = list(zip(starts, starts[1:]))[warm:]
    if not steps:
        return None
    median = statistics.median(b - a for a, b in steps)
    rows = []
    for a, b in steps:
        if b - a > 3 * median:
            continue
        inside = [e for e in xs if a <= e["ts"] < b]
        row = {"wall": b - a, "forward": 0.0, "backward": 0.0}
        row.update({p: 0.0 for p in PHASES})
        for e in inside:
            kind = e["name"].split(" ")[0]
            if e["tid"] == 0 and kind in ("forward", "backward"):
                row[kind] += e["dur"]
            elif e["tid"] == 3 and kind in PHASES:
                row[kind] += e["dur"]
        rows.append(row)
    mean = {k: sum(r[k] for r in rows) / len(rows) / 1e3 for k in rows[0]}
    mean["rest"] = mean["wall"] - sum(v for k, v in mean.items() if k != "wall")
    return len(rows), mean


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    warm = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    paths = sorted(glob.glob(os.path.join(sys.argv[1], "trace_rank*.json")))
    if not paths:
        print("trace_breakdown: no trace_rank*.json in %s" % sys.argv[1], file=sys.stderr)
        return 1
    for p in paths:
        b = breakdown(spans(p), warm)
        if b is None:
            print("%s: fewer than %d steps" % (os.path.basename(p), warm + 1))
            continue
        n, m = b
        phases = ", ".join("%s %.2f" % (k, m[k]) for k in PHASES)
        print("%s: %d steps, per step %.2f ms: forward %.2f, backward %.2f; phases: %s; rest %.2f"
              % (os.path.basename(p), n, m["wall"], m["forward"], m["backward"], phases, m["rest"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
