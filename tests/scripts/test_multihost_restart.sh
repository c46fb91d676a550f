#!/usr/bin/env bash
# Elastic restart on one host: `fsdp-run --max-restarts 1` around `fsdp-train --resume auto`.
# A rank SIGKILLed mid-run: fsdp-run stops the other rank, starts both again with
# TORCHELASTIC_RESTART_COUNT=1, fsdp-train continues from its newest checkpoint, and the run's
# losses after that step and its final evaluation equal an uninterrupted run's bit for bit.
# The same under real torchrun --standalone --max_restarts 1 --no_python.
# With --max-restarts, fsdp-run serves the store itself (TORCHELASTIC_USE_AGENT_STORE=True).
# (Two hosts restarting together: test_multihost_elastic.sh.) ~30 s.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=lib/script_test.sh
source "$HERE/lib/script_test.sh"
require_tools fsdp-run fsdp-train
require_fashion_mnist
FAIL_TAIL=20
STEPS=150
FLAGS=(--steps $STEPS --no-shuffle --log-every 1000)

RC=0
"$BIN/fsdp-run" --nproc 2 -- "$BIN/fsdp-train" "${FLAGS[@]}" --metrics "$WORK/full.jsonl" >"$WORK/full.out" 2>&1 || RC=$?
[[ $RC == 0 ]] || fail "uninterrupted run: exit $RC"

CK="$WORK/ckpt"
# kill_and_wait WHAT: SIGKILLs $victim (rank 1 of the first attempt); the launcher must restart
# the job and finish with exit 0.
kill_and_wait() {
  kill -KILL "$victim"
  RC=0
  wait "$launcher" || RC=$?
  [[ $RC == 0 ]] || fail "$1: exit $RC after one killed rank"
}
# check_resumed WHAT LOG METRICS [LAST_STEP]: the restarted attempt (LOG) resumed from a checkpoint
# >= step-10 (sets from), and its METRICS from there on equal the uninterrupted run's bitwise.
check_resumed() {
  local d
  from="$(grep -o "resumed from $CK/step-[0-9]* at step [0-9]*" "$2" | awk '{ print $NF }')"
  [[ "$from" =~ ^[0-9]+$ && "$from" -ge 10 ]] || fail "$1: the restarted attempt did not resume from a checkpoint >= step-10 ('$from')"
  d="$("$PY" "$HERE/lib/resumed_losses.py" "$WORK/full.jsonl" "$3" "$from" ${4:+"$4"} 2>&1)" ||
    fail "$1: restarted run differs from the uninterrupted one: $d"
}

"$BIN/fsdp-run" --nproc 2 --max-restarts 1 -- "$BIN/fsdp-train" "${FLAGS[@]}" --metrics "$WORK/restarted.jsonl" \
  --checkpoint-dir "$CK" --checkpoint-every 5 --keep-checkpoints 2 --resume auto >"$WORK/restarted.out" 2>&1 &
launcher=$!
wait_for 30 test -d "$CK/step-10" || fail "no checkpoint step-10 within 30 s"
victim=""
for pid in $(pgrep -P "$launcher" -x fsdp-train); do
  tr '\0' '\n' <"/proc/$pid/environ" | grep -qx "RANK=1" && victim="$pid"
done
[[ -n "$victim" ]] || fail "rank 1 of the first attempt not found"
kill_and_wait "--max-restarts 1"
grep -q "fsdp-run: rank 1 (pid $victim) was killed by signal 9" "$WORK/restarted.out" || fail "the kill is not reported"
grep -q "fsdp-run: restarting all 2 ranks (restart 1 of 1)" "$WORK/restarted.out" || fail "no restart line"
check_resumed "--max-restarts 1" "$WORK/restarted.out" "$WORK/restarted.jsonl" "$STEPS"
echo "ok: rank 1 killed, --max-restarts 1 resumed from step-$from; steps $((from + 1))-$STEPS and the final eval bitwise equal to an uninterrupted run"

# The same under real torchrun (agent store, keys under /worker/attempt_<n>): it restarts the
# group itself and fsdp-train recovers the same way.
if ! py_has torch.distributed.run; then
  skip_part "$PY has no torchrun (torch.distributed.run; $PY_MISSING); torchrun restart not checked"
else
  rm -rf "$CK"
  timeout -k 5 300 "${TORCHRUN[@]}" --standalone --nproc_per_node 2 --max_restarts 1 --no_python \
    "$BIN/fsdp-train" "${FLAGS[@]}" --metrics "$WORK/torchrun.jsonl" --checkpoint-dir "$CK" --checkpoint-every 5 \
    --keep-checkpoints 2 --resume auto >"$WORK/torchrun.out" 2>&1 &
  launcher=$!
  wait_for 30 test -d "$CK/step-10" || fail "torchrun: no checkpoint step-10 within 30 s"
  victim=""
  for pid in $(pgrep -x fsdp-train); do
    env_of="$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null || true)"
    # Ours: its command line names this run's checkpoint directory.
    grep -qx "RANK=1" <<<"$env_of" && grep -qx "TORCHELASTIC_RESTART_COUNT=0" <<<"$env_of" &&
      [[ "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" == *"$CK"* ]] && victim="$pid"
  done
  [[ -n "$victim" ]] || fail "torchrun: rank 1 of the first attempt not found"
  kill_and_wait "torchrun --max_restarts 1"
  check_resumed "torchrun" "$WORK/torchrun.out" "$WORK/torchrun.jsonl"
  echo "ok: torchrun --max_restarts 1: rank 1 killed, resumed from step-$from, later steps and final eval bitwise equal"
fi
echo "all restart checks passed"
