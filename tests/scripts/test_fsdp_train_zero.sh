#!/usr/bin/env bash
# fsdp-train --strategy zero1 | zero2 (the model unwrapped, fsdp::optim::ZeroRedundancyOptimizer):
# 20 mlp steps at 2 ranks give the losses of --strategy no_shard bit for bit (every gradient
# element is the same rank-order sum divided by N, Adam the same elementwise arithmetic on
# pieces), for adam and sgd; the metrics carry the memory keys, with no gradient bytes left
# after a zero2 step; --estimate-memory has ZERO1 and ZERO2 rows; checkpoints and bf16 are
# refused for now. About 1 minute on the loaded 2-core machine.
set -euo pipefail
# shellcheck source=lib/fsdp_train_test.sh
source "$(dirname "$0")/lib/fsdp_train_test.sh"

# Losses (repr) of a metrics file, one per line; checks the memory keys; $2: strategy.
losses() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
steps = [j for j in steps if "eval" not in j]
assert len(steps) == 20, f"{len(steps)} step lines, expected 20"
for j in steps:
    m = j["memory"]
    for k in ("param_bytes", "grad_bytes", "optim_bytes", "unsharded_peak_bytes", "rss_bytes"):
        assert isinstance(m.get(k), int) and m[k] >= 0, f"memory.{k} = {m.get(k)}"
    assert m["param_bytes"] > 0 and m["optim_bytes"] > 0, m
    if sys.argv[2] == "zero2":
        assert m["grad_bytes"] == 0, f"zero2 keeps {m['grad_bytes']} gradient bytes after the step"
    print(repr(j["loss"]))
PY
}

for opt in adam sgd; do
  for strategy in no_shard zero1 zero2; do
    run --strategy "$strategy" --optimizer "$opt" --steps 20 --no-shuffle --metrics "$WORK/$strategy-$opt.jsonl"
    [[ $RC == 0 ]] || fail "$strategy/$opt: exit status $RC"
    grep -q "test accuracy:" "$OUT" || fail "$strategy/$opt: no summary line"
    losses "$WORK/$strategy-$opt.jsonl" "$strategy" >"$WORK/$strategy-$opt.losses" || fail "$strategy/$opt: bad metrics"
  done
  for strategy in zero1 zero2; do
    cmp -s "$WORK/no_shard-$opt.losses" "$WORK/$strategy-$opt.losses" ||
      fail "$strategy/$opt losses differ from no_shard: $(paste -d' ' "$WORK/no_shard-$opt.losses" "$WORK/$strategy-$opt.losses" | head -n 3)"
    pass "$strategy/$opt: 20 losses equal to no_shard bit for bit (last $(tail -n 1 "$WORK/$strategy-$opt.losses"))"
  done
done

run --estimate-memory
[[ $RC == 0 ]] || fail "--estimate-memory: exit $RC"
for s in ZERO1 ZERO2; do grep -q "^$s " "$OUT" || fail "--estimate-memory: no $s line"; done
pass "--estimate-memory: ZERO1 and ZERO2 rows"

run --strategy zero2 --checkpoint-dir "$WORK/ckpt"
[[ $RC != 0 ]] && grep -qF -- "--checkpoint-dir and --resume are not supported with --strategy zero2 yet" "$OUT" ||
  fail "zero2 with --checkpoint-dir: expected a usage error"
run --strategy zero1 --mixed-precision bf16
[[ $RC != 0 ]] && grep -qF -- "--mixed-precision is not supported with --strategy zero1 yet" "$OUT" ||
  fail "zero1 with bf16: expected a usage error"
pass "checkpoints and bf16 refused under zero1/zero2"
echo "PASS"
