#!/usr/bin/env python3
"""Where a step's time goes across all ranks of a multi-host FSDP trace: before the link
fills, while it carries the replica all-reduces, and after.

    trace_link.py TRACE_DIR --unit LABEL [--skip 2]

TRACE_DIR holds trace_rank<R>.json of every rank (FSDP_TRACE=<dir>); their timestamps share
one clock (the system clock of one machine, as with simulated hosts). LABEL names the first
unit whose replica all-reduce fills the link (the first large unit in the reduction order).
A step runs from the first forward span of an iteration to the next one, on each rank; per
step and then as medians, in ms from the earliest rank's start of the step:
  forward_end     the latest rank's end of forward
  backward_end    the latest rank's end of LABEL's backward span
  reduce_issued   the latest rank's issue of LABEL's reduce-scatter
  link_start      the latest rank's issue of LABEL's replica all-reduce: the link carries
                  nothing large before every rank has issued it
  link_end        the latest end of any replica all-reduce
  step_end        the earliest rank's start of the next step
  link_ms         link_end - link_start, to compare with the link bound (measure_multihost.sh)
  tail_ms         step_end - link_end: what the step spends after the link has emptied (with
                  the optimizer after backward, mostly its step)
"""
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_timeline import load_steps  # noqa: E402


def rank_step(ev, t0, t1, unit):
    inside = [e for e in ev if t0 <= e["ts"] < t1]
    end = lambda e: e["ts"] + e["dur"]
    named = lambda n: next((e for e in inside if e["name"] == f"{n} {unit}"), None)
    bwd, red, rar = named("backward"), named("reduce"), named("replica_all_reduce")
    ras = [e for e in inside if e["name"].startswith("replica_all_reduce ")]
    if not (bwd and red and rar and ras):
        return None
    return {"start": t0, "forward_end": max(end(e) for e in inside if e["name"].startswith("forward ")),
            "backward_end": end(bwd), "reduce_issued": red["ts"], "link_start": rar["ts"],
            "link_end": max(end(e) for e in ras), "next": t1}


def main():
    trace_dir = Path(sys.argv[1])
    unit = sys.argv[sys.argv.index("--unit") + 1]
    skip = int(sys.argv[sys.argv.index("--skip") + 1]) if "--skip" in sys.argv else 2
    ranks = [load_steps(p) for p in sorted(trace_dir.glob("trace_rank*.json"))]
    if len(ranks) < 2:
        sys.exit(f"trace_link.py: fewer than two trace_rank*.json in {trace_dir}")
    n = min(len(starts) for _, starts in ranks)
    rows = []
    for i in range(skip, n - 1):
        per = [rank_step(ev, starts[i], starts[i + 1], unit) for ev, starts in ranks]
        if any(p is None for p in per):
            continue
        t0 = min(p["start"] for p in per)
        ms = lambda us: round((us - t0) / 1000.0, 2)
        row = {k: ms(max(p[k] for p in per)) for k in ("forward_end", "backward_end", "reduce_issued",
                                                       "link_start", "link_end")}
        row["step_end"] = ms(min(p["next"] for p in per))
        row["link_ms"] = round(row["link_end"] - row["link_start"], 2)
        row["tail_ms"] = round(row["step_end"] - row["link_end"], 2)
        rows.append(row)
        print(json.dumps(row))
    if not rows:
        sys.exit(f"trace_link.py: no step has unit {unit}'s backward, reduce-scatter and replica all-reduce")
    med = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
    print(json.dumps({"median_over_steps": len(rows), "ranks": len(ranks), "unit": unit, **med}))


if __name__ == "__main__":
    main()
