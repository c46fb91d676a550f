"""Checks that a restarted (or resumed) fsdp-train run continued the uninterrupted one bit for bit.

usage: resumed_losses.py [--rtol R] FULL.jsonl RESUMED.jsonl FROM [LAST]

Both files are fsdp-train --metrics output. The resumed run must have written steps FROM+1..LAST
(with LAST omitted: starting at FROM+1), each loss equal to the uninterrupted run's, and the same
final eval. With --rtol R (a resume at another world size or strategy, where float sums run in
another order), each loss and the final eval loss within R relative instead; prints the largest
relative difference. Exits non-zero with the first differences on stderr.
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


args = sys.argv[1:]
rtol = None
if args[:1] == ["--rtol"]:
    rtol, args = float(args[1]), args[2:]
(a, ea), (b, eb) = read(args[0]), read(args[1])
first = int(args[2]) + 1
if len(args) > 3:
    assert sorted(b) == list(range(first, int(args[3]) + 1)), f"restarted attempt wrote steps {min(b)}..{max(b)}"
else:
    assert b and min(b) == first, f"restarted attempt starts at step {min(b) if b else None}, expected {first}"
if rtol is None:
    bad = [f"step {k}: {b[k]!r} vs {a[k]!r}" for k in sorted(b) if b[k] != a[k]]
    assert not bad, "; ".join(bad[:3])
    assert ea == eb, f"final eval {eb} vs {ea}"
else:
    assert ea is not None and eb is not None, "missing final eval"
    pairs = [(f"step {k}", b[k], a[k]) for k in sorted(b)] + [("eval loss", eb["loss"], ea["loss"])]
    rel = [(abs(x - y) / abs(y), what, x, y) for what, x, y in pairs]
    bad = [f"{what}: {x!r} vs {y!r}" for r, what, x, y in rel if not r <= rtol]
    assert not bad, "; ".join(bad[:3])
    print("%.2g" % max(r for r, *_ in rel))
