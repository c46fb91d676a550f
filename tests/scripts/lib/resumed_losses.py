"""Checks that a restarted (or resumed) fsdp-train run continued the uninterrupted one bit for bit.

usage: resumed_losses.py FULL.jsonl RESUMED.jsonl FROM [LAST]

Both files are fsdp-train --metrics output. The resumed run must have written steps FROM+1..LAST
(with LAST omitted: starting at FROM+1), each loss equal to the uninterrupted run's, and the same
final eval. Exits non-zero with the first differences on stderr.
"""
import json
import sys


def read(path):
    steps, ev = {}, None
    for j in map(json.loads, open(path)):
        if "eval" in j:
            ev = j["eval"]
        else:
            steps[j["step"]] = j["loss"]
    return steps, ev


(a, ea), (b, eb) = read(sys.argv[1]), read(sys.argv[2])
first = int(sys.argv[3]) + 1
if len(sys.argv) > 4:
    assert sorted(b) == list(range(first, int(sys.argv[4]) + 1)), f"restarted attempt wrote steps {min(b)}..{max(b)}"
else:
    assert b and min(b) == first, f"restarted attempt starts at step {min(b) if b else None}, expected {first}"
bad = [f"step {k}: {b[k]!r} vs {a[k]!r}" for k in sorted(b) if b[k] != a[k]]
assert not bad, "; ".join(bad[:3])
assert ea == eb, f"final eval {eb} vs {ea}"
