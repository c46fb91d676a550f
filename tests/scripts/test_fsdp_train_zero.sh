#!/usr/bin/env bash
# fsdp-train --strategy zero1 | zero2 (the model unwrapped, fsdp::optim::ZeroRedundancyOptimizer):
# 20 mlp steps at 2 ranks give the losses of --strategy no_shard bit for bit (every gradient
# element is the same rank-order sum divided by N, Adam the same elementwise arithmetic on
# pieces), for adam and sgd; the metrics carry the memory keys, with no gradient bytes left
# after a zero2 step (with --offload-params only the host copy of the partition); --estimate-memory has ZERO1 and ZERO2 rows; checkpoints, --resume and
# bf16 (below). About 2.5 minutes on the loaded 2-core machine.
set -euo pipefail
# shellcheck source=lib/fsdp_train_test.sh
source "$(dirname "$0")/lib/fsdp_train_test.sh"

# Losses (repr) of a metrics file, one per line; checks the memory keys; $2: strategy.
losses() {
  "$PY" - "$1" "$2" <<'PY'
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
    if sys.argv[2] == "zero2-offload":  # only the host copy of the reduced partition, kept for the next step
        assert m["grad_bytes"] == steps[0]["memory"]["grad_bytes"] > 0, m
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

# zero2 --optimizer-in-backward --offload-params: each bucket's chunk copied to the host and
# stepped there as its reduce-scatter completes (host and device are one memory here), same losses.
flags="--optimizer-in-backward --offload-params"
# shellcheck disable=SC2086
run --strategy zero2 --optimizer adam $flags --steps 20 --no-shuffle --metrics "$WORK/inbwd.jsonl"
[[ $RC == 0 ]] || fail "zero2 $flags: exit status $RC"
losses "$WORK/inbwd.jsonl" zero2-offload >"$WORK/inbwd.losses" || fail "zero2 $flags: bad metrics"
cmp -s "$WORK/zero2-adam.losses" "$WORK/inbwd.losses" || fail "zero2 $flags changed the losses"
pass "zero2/adam $flags: 20 losses equal bit for bit"

run --estimate-memory
[[ $RC == 0 ]] || fail "--estimate-memory: exit $RC"
for s in ZERO1 ZERO2; do grep -q "^$s " "$OUT" || fail "--estimate-memory: no $s line"; done
pass "--estimate-memory: ZERO1 and ZERO2 rows"

# --- checkpoints and --resume --------------------------------------------------------------
# An uninterrupted run of 2K steps against K steps with --checkpoint-dir, then --resume auto up
# to 2K: under zero1 (fp32) and zero2 (bf16 parameters, fp32 masters) the losses of steps
# K+1..2K and the final eval are bitwise equal (parameters, masters, Adam moments and steps
# restored). Then ZeRO <-> FSDP at other world sizes (one format, records per original
# parameter): zero1's step-6 continues under full_shard at 4 ranks and no_shard at 1, and a
# full_shard step-K (2 ranks) under zero2 at 4 ranks, each within 1e-6 of the uninterrupted
# fp32 zero1 run (whose losses equal no_shard's bit for bit, above; float sums run in
# another order).
K=5
CK="$WORK/ckpt"
RESUMED="$(dirname "$0")/lib/resumed_losses.py"
for variant in "zero1:" "zero2:--mixed-precision bf16"; do
  s="${variant%%:*}"
  flags="--strategy $s --no-shuffle ${variant#*:}"
  # shellcheck disable=SC2086
  run $flags --steps $((2 * K)) --metrics "$WORK/$s.full.jsonl"
  [[ $RC == 0 ]] || fail "$s: uninterrupted run: exit $RC"
  # shellcheck disable=SC2086
  run $flags --steps $K --checkpoint-dir "$CK/$s" --checkpoint-every 2 --metrics "$WORK/$s.first.jsonl"
  [[ $RC == 0 ]] || fail "$s: run with --checkpoint-dir: exit $RC"
  [[ "$(ls "$CK/$s" | sort -V | tr '\n' ' ')" == "step-4 step-$K " ]] ||
    fail "$s: --keep-checkpoints 2 (default) left: $(ls "$CK/$s" | tr '\n' ' ')"
  # shellcheck disable=SC2086
  run $flags --steps $((2 * K)) --checkpoint-dir "$CK/$s" --checkpoint-every 2 --resume auto --keep-checkpoints 3 --metrics "$WORK/$s.resumed.jsonl"
  [[ $RC == 0 ]] || fail "$s: --resume auto: exit $RC"
  grep -q "resumed from $CK/$s/step-$K at step $K" "$OUT" || fail "$s: no 'resumed from .../step-$K' line"
  d="$("$PY" "$RESUMED" "$WORK/$s.full.jsonl" "$WORK/$s.resumed.jsonl" $K $((2 * K)) 2>&1)" ||
    fail "$s: the resumed run differs from the uninterrupted one: $d"
  [[ "$(ls "$CK/$s" | sort -V | tr '\n' ' ')" == "step-6 step-8 step-$((2 * K)) " ]] ||
    fail "$s: --keep-checkpoints 3 left: $(ls "$CK/$s" | tr '\n' ' ')"
  pass "$s ${variant#*:}: $K steps + --resume auto to $((2 * K)): losses and eval bitwise equal to the uninterrupted run; --keep-checkpoints kept the newest 2, then 3"
done
run --strategy full_shard --no-shuffle --steps $K --checkpoint-dir "$CK/fsdp"
[[ $RC == 0 ]] || fail "full_shard with --checkpoint-dir: exit $RC"
for variant in "zero1:6:full_shard:4" "zero1:6:no_shard:1" "fsdp:$K:zero2:4"; do
  IFS=: read -r from at to n <<<"$variant"
  run --strategy "$to" --nproc "$n" --no-shuffle --steps $((2 * K)) --resume "$CK/$from/step-$at" --metrics "$WORK/x-$to-$n.jsonl"
  [[ $RC == 0 ]] || fail "$from step-$at under $to at $n ranks: exit $RC"
  d="$("$PY" "$RESUMED" --rtol 1e-6 "$WORK/zero1.full.jsonl" "$WORK/x-$to-$n.jsonl" "$at" $((2 * K)) 2>&1)" ||
    fail "$from step-$at under $to at $n ranks differs from the uninterrupted zero1 run: $d"
  pass "$from (2 ranks) step-$at continued under $to at $n ranks: steps $((at + 1))-$((2 * K)) and eval within $d relative of the uninterrupted run"
done
echo "PASS"
