#!/usr/bin/env bash
# Elastic restart across two simulated hosts x 2 ranks (tests/scripts/lib/sim_hosts.sh), one
# `fsdp-run --nnodes 2 --max-restarts 1` per host, node 0's launcher serving the store:
#   1. Rank 3 (host 1) SIGKILLed mid-run around `fsdp-train --resume auto`: both launchers stop
#      their ranks and restart them together with TORCHELASTIC_RESTART_COUNT=1, training goes on
#      from the newest checkpoint, and the losses after it, the final evaluation and the final
#      checkpoint's weights and optimizer state equal an uninterrupted 2 x 2 run's bit for bit.
#   2. Every process of host 1 SIGKILLed (launcher, orphan guard, ranks): host 0's launcher and
#      ranks exit non-zero within 10 s, naming node 1's host and ranks, and no restart follows
#      (the lost node's ranks could never rejoin).
#   3. A rank that fails in every attempt: each attempt runs with the same
#      TORCHELASTIC_RESTART_COUNT on both nodes and the agent store; once the restarts are used
#      up, every launcher exits non-zero naming the failure.
# Needs root (namespaces): as another user it prints SKIP; under CI=true it fails instead.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=lib/two_hosts.sh
source "$HERE/lib/two_hosts.sh"
require_tools fsdp-run fsdp-train
require_fashion_mnist

# launch NAME ARGS...: one `fsdp-run --nnodes 2 $RUN_FLAGS -- fsdp-train ARGS` per host in the
# background, output in $WORK/NAME.h<i>.out; sets PIDS.
RUN_FLAGS=()
launch() {
  local name="$1" i
  shift
  PIDS=()
  for i in 0 1; do
    sim_host_run "$i" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" \
      --master-port "$PORT" --nproc 2 "${RUN_FLAGS[@]}" -- "$BIN/fsdp-train" "$@" >"$WORK/$name.h$i.out" 2>&1 &
    PIDS+=($!)
  done
}
# Waits for the launchers of launch; sets RCS ("rc0 rc1").
wait_all() {
  local rc0=0 rc1=0
  wait "${PIDS[0]}" || rc0=$?
  wait "${PIDS[1]}" || rc1=$?
  RCS="$rc0 $rc1"
}
# The pid of the process named $2 on host $1 whose environment has RANK=$3.
host_pid() {
  local pid
  for pid in $(ip netns pids "$(sim_ns "$1")"); do
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] || continue
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=$3" || continue
    echo "$pid"
    return 0
  done
  return 1
}

# --- 1. a rank killed mid-run: both nodes restart together, the result is bitwise the same --
STEPS=50
FLAGS=(--strategy hybrid_shard --steps $STEPS --no-shuffle --timeout 60 --log-every 1000
  --checkpoint-every 5 --keep-checkpoints 2 --resume auto)
t0="$(now)"
launch full "${FLAGS[@]}" --checkpoint-dir "$WORK/ck_full" --metrics "$WORK/full.jsonl"
wait_all
[[ "$RCS" == "0 0" ]] || fail "uninterrupted run: launcher exit codes $RCS"

CK="$WORK/ck"
RUN_FLAGS=(--max-restarts 1)
launch restarted "${FLAGS[@]}" --checkpoint-dir "$CK" --metrics "$WORK/restarted.jsonl"
wait_for 60 test -d "$CK/step-10" || fail "no checkpoint step-10 within 60 s"
victim="$(host_pid 1 fsdp-train 3)" || fail "rank 3 of the first attempt not found on host 1"
kill -KILL "$victim"
wait_all
[[ "$RCS" == "0 0" ]] || fail "--max-restarts 1: launcher exit codes $RCS after rank 3 was killed"
grep -q "^fsdp-run: rank 3 (pid $victim) was killed by signal 9 (SIGKILL)" "$WORK/restarted.h1.out" ||
  fail "host 1 does not report the kill"
grep -q "^fsdp-run: node 1 (simhost1): rank 3 (pid $victim) was killed by signal 9 (SIGKILL)" \
  "$WORK/restarted.h0.out" || fail "host 0 does not name node 1 and rank 3"
for h in 0 1; do
  [[ "$(grep -c "^fsdp-run: restarting all 4 ranks of the 2 nodes together, 2 here (restart 1 of 1)" \
    "$WORK/restarted.h$h.out")" == 1 ]] || fail "host $h: not exactly one restart line"
done
from="$(grep -o "resumed from $CK/step-[0-9]* at step [0-9]*" "$WORK/restarted.h0.out" | awk '{ print $NF }')"
[[ "$from" =~ ^[0-9]+$ && "$from" -ge 10 && "$from" -lt $STEPS ]] ||
  fail "the restarted attempt did not resume from a checkpoint >= step-10 ('$from')"
d="$("$PY" "$HERE/lib/resumed_losses.py" "$WORK/full.jsonl" "$WORK/restarted.jsonl" "$from" $STEPS 2>&1)" || fail "restarted run differs from the uninterrupted one: $d"
# The final checkpoints: every shard file (with HYBRID_SHARD one per rank of the first replica:
# its shard of the weights and of the Adam state; rank 0's also the RNG state) byte for byte.
final_a="$WORK/ck_full/step-$STEPS" final_b="$CK/step-$STEPS"
files="$(cd "$final_a" && ls | grep -v '^metadata.json$')" || true
[[ "$(echo "$files" | wc -w)" -ge 2 ]] || fail "the final checkpoint $final_a holds only: $(ls "$final_a")"
[[ "$(ls "$final_a" | tr '\n' ' ')" == "$(ls "$final_b" | tr '\n' ' ')" ]] ||
  fail "final checkpoints hold different files: $(ls "$final_a" | tr '\n' ' ') vs $(ls "$final_b" | tr '\n' ' ')"
for f in $files; do
  cmp -s "$final_a/$f" "$final_b/$f" || fail "final checkpoint file $f differs from the uninterrupted run's"
done
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }')"
pass "rank 3 killed on host 1: both nodes restarted together, resumed from step-$from; steps $((from + 1))-$STEPS, \
the final eval and the final checkpoint's $(echo "$files" | wc -w) rank files bitwise equal to an uninterrupted run (${elapsed} s)"

# --- 2. every process of host 1 killed: host 0 stops within 10 s and does not restart ------
t0="$(now)"
launch lost --strategy hybrid_shard --steps 100000 --no-shuffle --timeout 60 --log-every 1 --metrics "$WORK/lost.jsonl"
wait_for 60 has_lines "$WORK/lost.jsonl" 3 || fail "lost: training did not start within 60 s"
# All at once, as when the machine dies: no launcher gets to say goodbye.
# shellcheck disable=SC2046
kill -KILL $(ip netns pids "$(sim_ns 1)")
t_kill="$(now)"
rc0=0
wait "${PIDS[0]}" || rc0=$?
stop_s="$(awk -v a="$t_kill" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
wait "${PIDS[1]}" || true
[[ $rc0 != 0 ]] || fail "lost: host 0's launcher exited 0 after host 1 died"
awk -v e="$stop_s" 'BEGIN { exit !(e < 10) }' || fail "lost: host 0 took $stop_s s to stop (limit 10 s)"
# (Host 0's own ranks may notice the dead peers first; the launcher names the lost node anyway.)
grep -q "^fsdp-run: node 1 (simhost1, ranks 2-3): its launcher is gone (connection closed)" \
  "$WORK/lost.h0.out" || fail "lost: host 0 does not name node 1's host and ranks"
grep -q "^fsdp-run: no restart: the launcher of node 1 (simhost1, ranks 2-3) is gone, and its ranks cannot rejoin the job" \
  "$WORK/lost.h0.out" || fail "lost: host 0 does not say why it does not restart"
! grep -q "restarting" "$WORK/lost.h0.out" || fail "lost: host 0 restarted without node 1"
left="$(ip netns pids "$(sim_ns 0)")"
[[ -z "$left" ]] || fail "lost: processes left on host 0: $(ps -o pid,comm -p "$(echo $left | tr ' ' ',')")"
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }')"
pass "every process of host 1 killed: host 0's launcher and ranks stopped in $stop_s s (exit $rc0) naming node 1 \
(simhost1, ranks 2-3), no restart attempted (${elapsed} s)"

# --- 3. restarts used up: every launcher exits non-zero naming the failure -------------------
t0="$(now)"
PIDS=()
for i in 0 1; do
  sim_host_run "$i" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" --master-port "$PORT" \
    --nproc 2 --max-restarts 1 -- sh -c 'echo "attempt $TORCHELASTIC_RESTART_COUNT store $TORCHELASTIC_USE_AGENT_STORE"
      if [ "$RANK" = 3 ]; then sleep 1; exit 5; fi; exec sleep 30' >"$WORK/used.h$i.out" 2>&1 &
  PIDS+=($!)
done
wait_all
[[ "$RCS" == "1 5" ]] || fail "used up: launcher exit codes $RCS, expected 1 (host 0) and 5 (rank 3's code, host 1)"
for i in 0 1; do
  got="$(grep -o '^\[rank[0-3]\]: attempt .*' "$WORK/used.h$i.out" | sort | tr '\n' ' ')"
  want="$(for r in $((2 * i)) $((2 * i + 1)); do for a in 0 1; do echo "[rank$r]: attempt $a store True"; done; done | tr '\n' ' ')"
  [[ "$got" == "$want" ]] || fail "used up: host $i's ranks printed '$got', expected '$want'"
done
grep -q "^fsdp-run: no restart left (--max-restarts 1 used up); the job failed: rank 3 (pid [0-9]*) exited with code 5$" \
  "$WORK/used.h1.out" || fail "used up: host 1 does not name the failure"
grep -q "^fsdp-run: no restart left (--max-restarts 1 used up); the job failed: node 1 (simhost1): rank 3 (pid [0-9]*) exited with code 5$" \
  "$WORK/used.h0.out" || fail "used up: host 0 does not name the failure"
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }')"
pass "rank 3 failing in both attempts: every rank saw the same restart count and the agent store; once the restart was used, \
both launchers exited non-zero (1, 5) naming rank 3's failure (${elapsed} s)"
echo "all elastic multihost checks passed"
