#!/usr/bin/env python3
"""Per-step timeline of one rank's FSDP trace (FSDP_TRACE=<dir>, trace_rank<R>.json).

    trace_timeline.py TRACE_JSON [--skip 2]

A step runs from the first forward span of the iteration to the first forward span of
the next. For each step (the first --skip steps left out) prints, in ms from the step's
start: where forward and backward end, each reduction's span (issue -> complete on this
rank) and each replica all-reduce's span (issued -> taken back by the backward thread),
and the step's end; then the medians over steps as one JSON line.

With the optimizer inside backward (the runtime's "step <unit>" spans) each step also gets
optimizer_ms, the time of those spans, and exposed_ms, the part of it after the step's last
reduction (reduce-scatter or replica all-reduce) ended: what the link no longer hides. The
median line then adds hidden = 1 - sum(exposed_ms) / sum(optimizer_ms) over the steps.
"""
import json
import statistics
import sys


def load_steps(path):
    """The trace's spans in begin order, and the start of each iteration (also trace_link.py's)."""
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    ev.sort(key=lambda e: e["args"]["begin_seq"])
    # Iteration boundaries: a forward span whose predecessor (in begin order) was not a forward.
    starts, prev_fwd = [], False
    for e in ev:
        is_fwd = e["name"].startswith("forward ")
        if is_fwd and not prev_fwd:
            starts.append(e["ts"])
        if e["tid"] == 0:
            prev_fwd = is_fwd
    return ev, starts


def main():
    path = sys.argv[1]
    skip = int(sys.argv[sys.argv.index("--skip") + 1]) if "--skip" in sys.argv else 2
    ev, starts = load_steps(path)
    rows = []
    for i in range(skip, len(starts) - 1):
        t0, t1 = starts[i], starts[i + 1]
        inside = [e for e in ev if t0 <= e["ts"] < t1]
        ms = lambda us: round((us - t0) / 1000.0, 2)
        row = {"step_ms": ms(t1)}
        fwd = [e for e in inside if e["name"].startswith("forward ")]
        bwd = [e for e in inside if e["name"].startswith("backward ")]
        row["forward_end"] = ms(max(e["ts"] + e["dur"] for e in fwd)) if fwd else None
        row["backward_end"] = ms(max(e["ts"] + e["dur"] for e in bwd)) if bwd else None
        for e in bwd:
            row[e["name"]] = [ms(e["ts"]), ms(e["ts"] + e["dur"])]
        reductions = [e for e in inside if e["tid"] == 2]
        for e in reductions:
            row[e["name"]] = [ms(e["ts"]), ms(e["ts"] + e["dur"])]
        steps = [e for e in inside if e["name"].startswith("step ")]
        if steps and reductions:
            link_end = max(e["ts"] + e["dur"] for e in reductions)
            row["optimizer_ms"] = round(sum(e["dur"] for e in steps) / 1000.0, 3)
            row["exposed_ms"] = round(sum(max(0, e["ts"] + e["dur"] - max(e["ts"], link_end)) for e in steps) / 1000.0, 3)
        rows.append(row)
        print(json.dumps(row))
    med = {}
    for k in rows[0] if rows else []:
        vals = [r[k] for r in rows if k in r and r[k] is not None]
        if not vals:
            continue
        if isinstance(vals[0], list):
            med[k] = [round(statistics.median(v[0] for v in vals), 2), round(statistics.median(v[1] for v in vals), 2)]
        else:
            med[k] = round(statistics.median(vals), 2)
    timed = [r for r in rows if r.get("optimizer_ms")]
    if timed:
        med["hidden"] = round(1 - sum(r["exposed_ms"] for r in timed) / sum(r["optimizer_ms"] for r in timed), 3)
    print(json.dumps({"median_over_steps": len(rows), **med}))


if __name__ == "__main__":
    main()
