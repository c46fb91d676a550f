#!/usr/bin/env bash
# Checkpoints written by the libtorch 1.13 build (tests/fixtures/ckpt-1.13, README there) read
# by this build: fsdp-ckpt inspect verifies them, fsdp-ckpt consolidate gives the 1.13 build's
# consolidated file byte for byte, and fsdp-train resumes them (FULL_SHARD -> FULL_SHARD, ZERO1 ->
# ZERO1, ZERO1 -> FULL_SHARD, 2 ranks) with the losses of steps 11-20 and the final eval of the
# uninterrupted 1.13 run within 1e-6 relative (1.13 against itself: bit-equal; on libtorch 2.11
# steps 11-16 differ by 1.19e-7, 5.6e-8 relative). About 12 s on the loaded 2-core machine.
set -euo pipefail
# shellcheck source=lib/fsdp_train_test.sh
source "$(dirname "$0")/lib/fsdp_train_test.sh"
require_tools fsdp-ckpt
FIX="$(cd "$(dirname "$0")/../fixtures/ckpt-1.13" && pwd)"
RESUMED="$(dirname "$0")/lib/resumed_losses.py"

# Copies: the tree's fixture is never handed to a tool that could write next to it.
for s in full_shard zero1; do cp -r "$FIX/$s/step-10" "$WORK/$s-step-10"; done

for s in full_shard zero1; do
  "$BIN/fsdp-ckpt" inspect "$WORK/$s-step-10" >"$WORK/inspect-$s.out" 2>&1 ||
    fail "fsdp-ckpt inspect $s/step-10: exit status $?"
  grep -q "trainer.step = 10" "$WORK/inspect-$s.out" || fail "inspect $s: no trainer.step = 10"
  [[ $(grep -c "checksum ok" "$WORK/inspect-$s.out") == 2 ]] || fail "inspect $s: not 2 rank files with checksum ok"
  pass "fsdp-ckpt inspect $s/step-10: both rank files verified"
done

"$BIN/fsdp-ckpt" consolidate "$WORK/full_shard-step-10" "$WORK/model.pt" >"$WORK/consolidate.out" 2>&1 ||
  fail "fsdp-ckpt consolidate: exit status $?"
cmp -s "$WORK/model.pt" "$FIX/full_shard/model_step10.pt" ||
  fail "consolidate of full_shard/step-10 differs from the 1.13 build's model_step10.pt"
pass "fsdp-ckpt consolidate: the 1.13 build's model_step10.pt byte for byte"

# The fixture's flags (README); only --strategy and --resume vary.
for pair in full_shard:full_shard zero1:zero1 zero1:full_shard; do
  from=${pair%%:*} as=${pair##*:}
  run --model mlp --hidden 16 --nproc 2 --strategy "$as" --optimizer adam --steps 20 \
    --resume "$WORK/$from-step-10" --metrics "$WORK/$from-as-$as.jsonl"
  [[ $RC == 0 ]] || fail "$from/step-10 resumed as $as: exit status $RC"
  grep -q "resumed from .* at step 10" "$OUT" || fail "$from/step-10 as $as: no 'resumed ... at step 10' line"
  rel=$(/usr/bin/python3 "$RESUMED" --rtol 1e-6 "$FIX/$from/metrics.jsonl" "$WORK/$from-as-$as.jsonl" 10 20) ||
    fail "$from/step-10 resumed as $as: losses off the 1.13 run's"
  pass "$from/step-10 (1.13) resumed as $as: steps 11-20 and eval within $rel relative of the 1.13 run"
done
