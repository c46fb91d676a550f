#!/usr/bin/env bash
# fsdp-train --activation-checkpointing (gpt blocks recomputed in backward): 5 steps of a small
# gpt at 2 ranks give the losses and the validation loss of the same run without it, bit for
# bit, under full_shard and zero2; the flag is refused for a model without blocks.
set -euo pipefail
# shellcheck source=lib/script_test.sh
source "$(dirname "$0")/lib/script_test.sh"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
require_tools fsdp-train fsdp-run
TRAIN="$BIN/fsdp-train"
GPT=(--model gpt --layers 3 --dim 32 --heads 2 --context 32 --batch-size 8 --steps 5 --nproc 2)

losses() {  # METRICS: every step's loss and the evaluation's, repr, one per line
  "$PY" - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    print(repr(j.get("loss", j.get("eval"))))
PY
}

for strategy in full_shard zero2; do
  for flag in "" --activation-checkpointing; do
    name="$strategy${flag:+-ckpt}"
    "$TRAIN" "${GPT[@]}" --strategy "$strategy" --metrics "$WORK/$name.jsonl" $flag >"$WORK/$name.out" 2>&1 ||
      fail "$name: exit status $?"
    losses "$WORK/$name.jsonl" >"$WORK/$name.losses"
  done
  [[ "$(wc -l <"$WORK/$strategy.losses")" -ge 6 ]] || fail "$strategy: $(wc -l <"$WORK/$strategy.losses") metrics lines"
  cmp -s "$WORK/$strategy.losses" "$WORK/$strategy-ckpt.losses" ||
    fail "$strategy: losses with --activation-checkpointing differ: $(paste -d' ' "$WORK/$strategy.losses" "$WORK/$strategy-ckpt.losses" | head -n 3)"
  pass "$strategy: $(wc -l <"$WORK/$strategy.losses") losses equal with and without --activation-checkpointing"
done

if "$TRAIN" --model mlp --activation-checkpointing --steps 1 >"$WORK/mlp.out" 2>&1; then
  fail "--activation-checkpointing accepted for --model mlp"
fi
grep -q -- "--activation-checkpointing applies to --model gpt only" "$WORK/mlp.out" ||
  fail "the refusal does not name the flag and the model: $(tail -n 2 "$WORK/mlp.out")"
pass "--activation-checkpointing is refused for --model mlp"
