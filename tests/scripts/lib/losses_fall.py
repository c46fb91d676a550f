"""Checks that a run's JSON-lines losses fall.

usage: losses_fall.py RUN.jsonl [RATIO]

RUN.jsonl holds {"step": S, "loss": L} lines (other lines, such as {"step": S, "eval": {...}},
are ignored). The steps must be 1..N in order with N >= 8, every loss finite, and the mean loss
of the last quarter of the steps below RATIO (default 0.6) times the mean of the first three.
Exits non-zero naming what failed.
"""
import json
import math
import sys

path = sys.argv[1]
ratio = float(sys.argv[2]) if len(sys.argv) > 2 else 0.6
rows = [j for j in map(json.loads, open(path)) if "loss" in j]
steps = [j["step"] for j in rows]
assert steps == list(range(1, len(steps) + 1)), f"{path}: steps are {steps[:3]}...{steps[-3:]}, expected 1..N"
assert len(steps) >= 8, f"{path}: {len(steps)} steps, need at least 8 to judge"
losses = [j["loss"] for j in rows]
assert all(math.isfinite(v) for v in losses), f"{path}: a loss is not finite: {losses}"
first = sum(losses[:3]) / 3
tail = losses[-(len(losses) // 4):]
last = sum(tail) / len(tail)
assert last < ratio * first, f"{path}: loss did not fall: first three mean {first:.4g}, last {len(tail)} mean {last:.4g} (need < {ratio} x)"
print(f"{path}: loss fell from {first:.4g} (first 3 steps) to {last:.4g} (last {len(tail)})")
