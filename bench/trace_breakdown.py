#!/usr/bin/env python3
"""Where a step's time goes, from FSDP's schedule traces (FSDP_TRACE=DIR, docs/usage.md).

For each trace_rank*.json in DIR: the steady steps (from one "forward 0" span to the next,
leaving out the first WARM steps and any step over 3x the median, e.g. a checkpoint or a
warm-up), and per step on average: the wall time, the compute thread's forward and backward
spans, and the rest of the compute thread's time (waits for gathers and reductions, gradient
flattening, the optimizer, hooks).

  FSDP_TRACE=/tmp/tr OMP_NUM_THREADS=1 build/bin/fsdp-run --nproc 2 -- build/bin/bench_strategies \
      --model transformer --strategy full_shard --optim cpuadam --prefetch default --shard-group 0 \
      --bucket-mb 0 --steps 10 --warmup 3 --optimizer-in-backward
  python3 bench/trace_breakdown.py /tmp/tr [WARM]
"""
import glob
import json
import os
import statistics
import sys


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
        compute = [e for e in xs if a <= e["ts"] < b and e["tid"] == 0]
        fwd = sum(e["dur"] for e in compute if e["name"].startswith("forward"))
        bwd = sum(e["dur"] for e in compute if e["name"].startswith("backward"))
        rows.append(((b - a) / 1e3, fwd / 1e3, bwd / 1e3))
    n = len(rows)
    step, fwd, bwd = (sum(r[i] for r in rows) / n for i in range(3))
    return n, step, fwd, bwd, step - fwd - bwd


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
        print("%s: %d steps, per step %.1f ms: forward %.1f, backward %.1f, other %.1f" % ((os.path.basename(p),) + b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
