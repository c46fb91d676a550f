#!/usr/bin/env bash
# Two simulated hosts x 2 ranks (tests/scripts/lib/sim_hosts.sh: own network, hostname and
# /dev/shm per host), launched the way two machines would be: one `fsdp-run --nnodes 2` per
# host. Gloo between hosts over TCP (no GLOO_SOCKET_IFNAME: each rank must find the address
# that reaches MASTER_ADDR itself), shared memory only inside a host.
#   1. HYBRID_SHARD (shard group = a host) and FULL_SHARD (groups span hosts) train the mlp
#      and match unsharded single-process PyTorch.
#      A rank on another host advertising loopback (GLOO_SOCKET_IFNAME=lo) is refused at once.
#   2. --keep-checkpoints and --resume auto (a corrupted newest checkpoint is passed over).
#   3. A rank killed on host 1: host 0's launcher and ranks exit non-zero within seconds,
#      naming the dead rank.
#   4. The link cut mid-training: --timeout 5 bounds how long every rank waits.
#   5. The link cut during a checkpoint save: the interrupted save is left as DIR/step-S.tmp,
#      never as a complete-looking DIR/step-S; --resume auto takes the one before it and
#      continues bitwise as the cut run did.
# (Section 0 checks multi-node fsdp-run itself: environment, agreement, a lost launcher.)
# Needs root (namespaces): as another user it prints SKIP; under CI=true it fails instead.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=lib/sim_hosts.sh
source "$HERE/lib/sim_hosts.sh"
sim_hosts_require

BIN="${FSDP_BIN_DIR:?set FSDP_BIN_DIR to the bin directory of a build}"
for t in fsdp-run fsdp-train; do
  [[ -x "$BIN/$t" ]] || { echo "FAIL: $BIN/$t is not an executable (build targets fsdp-train fsdp-run)"; exit 1; }
done
DATA=/usr/share/datasets/fashion-mnist
[[ -f "$DATA/train-images-idx3-ubyte.gz" ]] || { echo "FAIL: $DATA missing (apt-get install dataset-fashion-mnist)"; exit 1; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
sim_hosts_create 2
unset GLOO_SOCKET_IFNAME
# Each host has its own network stack, so a fixed port cannot collide with anything.
PORT=29500

fail() {
  echo "FAIL: $*" >&2
  for f in "$WORK"/*.out; do
    [[ -f "$f" ]] && { echo "--- $(basename "$f"):" >&2; tail -n 25 "$f" >&2; }
  done
  exit 1
}
pass() { echo "ok: $*"; }
now() { date +%s.%N; }

# launch NAME ARGS...: one fsdp-run per host in the background, output in $WORK/NAME.h<i>.out;
# sets PIDS. HOST1_ENV=NAME=VALUE adds one variable on host 1 only.
launch() {
  local name="$1" i
  shift
  PIDS=()
  rm -f "$WORK/$name".h*.out
  for i in 0 1; do
    local extra=()
    [[ $i == 1 && -n "${HOST1_ENV:-}" ]] && extra=(env "$HOST1_ENV")
    sim_host_run "$i" "${extra[@]}" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" \
      --master-port "$PORT" --nproc 2 -- "$BIN/fsdp-train" "$@" >"$WORK/$name.h$i.out" 2>&1 &
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

# The pid of the process named $2 on host $1 whose environment has RANK=$3 (any if $3 is empty).
host_pid() {
  local pid
  for pid in $(ip netns pids "$(sim_ns "$1")"); do
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] || continue
    [[ -z "${3:-}" ]] || tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=$3" || continue
    echo "$pid"
    return 0
  done
  return 1
}

# --- 0. multi-node fsdp-run: environment, agreement, lost launcher ---------------------------
# run_node NAME HOST NODE_RANK FSDP_RUN_ARGS... -- CMD: one launcher in the background (PIDS+=).
run_node() {
  local name="$1" host="$2" node="$3"
  shift 3
  sim_host_run "$host" "$BIN/fsdp-run" --master-addr "${SIM_ADDR[0]}" --master-port "$PORT" \
    --node-rank "$node" "$@" >"$WORK/$name.h$host.n$node.out" 2>&1 &
  PIDS+=($!)
}
PIDS=()
for i in 0 1; do
  run_node env "$i" "$i" --nnodes 2 --nproc 2 -- sh -c \
    'echo "$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $ROLE_RANK $MASTER_ADDR $(hostname)"'
done
wait_all
[[ "$RCS" == "0 0" ]] || fail "env: launcher exit codes $RCS"
got="$(cat "$WORK"/env.*.out | sort)"
want="$(printf '%s\n' "[rank0]: 0 0 4 2 0 2 0 ${SIM_ADDR[0]} simhost0" "[rank1]: 1 1 4 2 0 2 1 ${SIM_ADDR[0]} simhost0" \
  "[rank2]: 2 0 4 2 1 2 2 ${SIM_ADDR[0]} simhost1" "[rank3]: 3 1 4 2 1 2 3 ${SIM_ADDR[0]} simhost1")"
[[ "$got" == "$want" ]] || fail "env: ranks saw
$got
expected
$want"
pass "2 nodes x 2: RANK = node_rank * 2 + LOCAL_RANK and every torchrun variable set"

PIDS=()
run_node disagree 0 0 --nnodes 2 --nproc 2 -- true
run_node disagree 1 1 --nnodes 2 --nproc 3 -- true
wait_all
[[ "$RCS" == "1 1" ]] || fail "disagree: launcher exit codes $RCS, expected 1 1"
for f in "$WORK"/disagree.*.out; do
  grep -q "nodes disagree: the launcher on simhost1 (--node-rank 1) has --nnodes 2 --nproc 3, node 0 (simhost0) has --nnodes 2 --nproc 2" "$f" ||
    fail "disagree: $(basename "$f") lacks the disagreement message: $(cat "$f")"
done
PIDS=()
run_node dup 0 0 --nnodes 3 -- true
run_node dup 1 1 --nnodes 3 -- true
run_node dup 0 1 --nnodes 3 -- true
wait "${PIDS[0]}" && fail "dup: node 0 exited 0 with node rank 1 given twice"
grep -q "node rank 1 claimed twice: by simhost[01] and by simhost[01]; give each node its own --node-rank 0..2" "$WORK/dup.h0.n0.out" ||
  fail "dup: node 0 does not name both hosts: $(cat "$WORK/dup.h0.n0.out")"
wait "${PIDS[1]}" || true
wait "${PIDS[2]}" || true
RC=0
sim_host_run 1 "$BIN/fsdp-run" --nnodes 2 --node-rank 1 --master-addr "${SIM_ADDR[0]}" --master-port "$PORT" \
  --rdzv-timeout 1 -- true >"$WORK/alone.out" 2>&1 || RC=$?
[[ $RC == 1 ]] && grep -q "cannot reach node 0's launcher at ${SIM_ADDR[0]}:$((PORT + 1)) (MASTER_PORT+1) within 1 s" "$WORK/alone.out" ||
  fail "node 1 without node 0: exit $RC, $(cat "$WORK/alone.out")"
pass "launchers refuse different --nproc, a node rank given twice (naming both hosts), and name an unreachable node 0"

# Host 1's launcher killed: its ranks die with it (orphan guard), host 0 stops and says why.
PIDS=()
run_node lost 0 0 --nnodes 2 -- sleep 60
run_node lost 1 1 --nnodes 2 -- sleep 60
for _ in $(seq 1 100); do
  host_pid 1 sleep >/dev/null && break
  sleep 0.1
done
lost_pid="$(host_pid 1 fsdp-run)" || fail "lost: host 1's launcher not found"
kill -KILL $lost_pid
t0="$(now)"
wait_all
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
[[ "${RCS%% *}" == 1 ]] || fail "lost: host 0's launcher exit code ${RCS%% *}, expected 1"
awk -v e="$elapsed" 'BEGIN { exit !(e < 10) }' || fail "lost: host 0 took $elapsed s to stop (limit 10 s)"
grep -q "fsdp-run: node 1 (simhost1, rank 1): its launcher is gone (connection closed); stopping 1 local rank" "$WORK/lost.h0.n0.out" ||
  fail "lost: host 0 does not name node 1: $(cat "$WORK/lost.h0.n0.out")"
pass "host 1's launcher killed: host 0 stopped in $elapsed s naming node 1"

# --- 1. training across hosts matches single-process PyTorch --------------------------------
STEPS=10
/usr/bin/python3 "$HERE/lib/mlp_reference.py" "$DATA" $STEPS 64 0.001 >"$WORK/mlp.ref" ||
  fail "the PyTorch reference failed"
# The hybrid run also checkpoints (see section 2): 20 steps, the first 10 compared here.
CK="$WORK/ckpt"
CKFLAGS=(--checkpoint-dir "$CK" --checkpoint-every 5 --keep-checkpoints 2 --resume auto)
for strategy in hybrid_shard full_shard; do
  extra=(--steps $STEPS)
  [[ $strategy == hybrid_shard ]] && extra=(--steps $((2 * STEPS)) "${CKFLAGS[@]}")
  launch "$strategy" --strategy "$strategy" --no-shuffle --timeout 60 \
    --metrics "$WORK/$strategy.jsonl" "${extra[@]}"
  wait_all
  [[ "$RCS" == "0 0" ]] || fail "$strategy: launcher exit codes (host 0, host 1) = $RCS"
  # Every rank names its host's hostname: proof the ranks really ran on two hosts.
  grep -q "simhost1" "$WORK/$strategy.h1.out" || true
  d="$(/usr/bin/python3 -c '
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1]) if "eval" not in l]
b = [float(l) for l in open(sys.argv[2])]
assert len(a) >= len(b) == int(sys.argv[3]), f"{len(a)} losses vs {len(b)} of the reference"
rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
print("%.2g" % max(rel))
assert max(rel) < 1e-4, "\n".join(f"step {i + 1}: {x!r} vs {y!r}" for i, (x, y) in enumerate(zip(a, b)))
' "$WORK/$strategy.jsonl" "$WORK/mlp.ref" $STEPS 2>&1)" ||
    fail "$strategy on 2 hosts x 2 ranks: losses differ from unsharded PyTorch: $d"
  pass "$strategy on 2 hosts x 2 ranks: $STEPS losses match unsharded PyTorch (max rel. diff $d)"
done

# GLOO_SOCKET_IFNAME=lo on host 1 (it wins over the route to MASTER_ADDR): its ranks advertise
# 127.0.0.1 to host 0, which says so at once instead of waiting out the 60 s timeout.
t0="$(now)"
HOST1_ENV=GLOO_SOCKET_IFNAME=lo launch lo --steps 2 --timeout 60
wait_all
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
[[ "${RCS%% *}" != 0 && "${RCS##* }" != 0 ]] ||
  fail "GLOO_SOCKET_IFNAME=lo on host 1: launcher exit codes $RCS, expected both non-zero"
awk -v e="$elapsed" 'BEGIN { exit !(e < 30) }' || fail "GLOO_SOCKET_IFNAME=lo on host 1: took $elapsed s (limit 30 s)"
grep -q "rank [23] on host simhost1 advertises the loopback address 127.0.0.1 to Gloo, which no other host can reach; on simhost1 unset GLOO_SOCKET_IFNAME" "$WORK/lo.h0.out" ||
  fail "GLOO_SOCKET_IFNAME=lo on host 1: host 0 does not report the loopback address: $(grep -v '^\[rank.\]: fsdp-train: mlp' "$WORK/lo.h0.out" | head -n 5)"
pass "GLOO_SOCKET_IFNAME=lo on host 1: refused in $elapsed s naming the host and the fix"

# --- 2. --keep-checkpoints and --resume auto across hosts --------------------------------------
# The hybrid run of section 1 started with --resume auto on an empty directory, saved steps 0, 5,
# 10, 15, 20 and kept the newest 2. With step-20's metadata corrupted, the same command reports
# it, continues from step-15, and its steps 16..20 equal the first run's bit for bit.
grep -q "no usable checkpoint under $CK; starting fresh" "$WORK/hybrid_shard.h0.out" ||
  fail "resume auto: the first run does not say it starts fresh"
[[ "$(ls "$CK" | tr '\n' ' ')" == "step-15 step-20 " ]] || fail "keep-checkpoints 2: $CK holds $(ls "$CK" | tr '\n' ' ')"
echo '{"truncated' >"$CK/step-20/metadata.json"
launch resumed --strategy hybrid_shard --steps $((2 * STEPS)) --no-shuffle --timeout 60 \
  --metrics "$WORK/resumed.jsonl" "${CKFLAGS[@]}"
wait_all
[[ "$RCS" == "0 0" ]] || fail "resume auto: launcher exit codes $RCS"
grep -q "resumed from $CK/step-15 at step 15" "$WORK/resumed.h0.out" || fail "resume auto: no 'resumed from $CK/step-15' line"
grep -q "resume auto: skipped: --resume $CK/step-20: unreadable metadata.json" "$WORK/resumed.h0.out" ||
  fail "resume auto: the corrupted step-20 is not reported"
d="$(/usr/bin/python3 -c '
import json, sys
def steps(p):
    return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "eval" not in j}
a, b = steps(sys.argv[1]), steps(sys.argv[2])
assert sorted(b) == list(range(16, 21)), f"resumed steps {sorted(b)}"
bad = [f"step {k}: {b[k]!r} vs {a[k]!r}" for k in b if b[k] != a[k]]
assert not bad, "; ".join(bad)
' "$WORK/hybrid_shard.jsonl" "$WORK/resumed.jsonl" 2>&1)" || fail "resume auto: $d"
[[ "$(ls "$CK" | tr '\n' ' ')" == "step-15 step-20 " ]] || fail "keep-checkpoints 2 after resuming: $CK holds $(ls "$CK" | tr '\n' ' ')"
pass "--resume auto skipped a corrupted step-20, continued from step-15 (steps 16-20 bitwise equal), --keep-checkpoints 2 kept step-15 and step-20"

# --- 3. a rank killed on host 1 stops host 0 within seconds ----------------------------------
launch kill --strategy hybrid_shard --steps 100000 --no-shuffle --timeout 60 --log-every 1 \
  --metrics "$WORK/kill.jsonl"
for _ in $(seq 1 600); do
  [[ -f "$WORK/kill.jsonl" && "$(wc -l <"$WORK/kill.jsonl")" -ge 3 ]] && break
  sleep 0.1
done
[[ -f "$WORK/kill.jsonl" && "$(wc -l <"$WORK/kill.jsonl")" -ge 3 ]] || fail "kill: training did not start within 60 s"
victim="$(host_pid 1 fsdp-train 3)" || fail "kill: no fsdp-train with RANK=3 on host 1"
kill -KILL "$victim"
t0="$(now)"
rc0=0
wait "${PIDS[0]}" || rc0=$?
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
rc1=0
wait "${PIDS[1]}" || rc1=$?
[[ $rc0 != 0 ]] || fail "kill: host 0's launcher exited 0 after rank 3 was killed"
[[ $rc1 == 137 ]] || fail "kill: host 1's launcher exit code $rc1, expected 137 (rank 3's SIGKILL)"
awk -v e="$elapsed" 'BEGIN { exit !(e < 10) }' || fail "kill: host 0 took $elapsed s to stop (limit 10 s)"
grep -q "node 1 (simhost1): rank 3 (pid $victim) was killed by signal 9" "$WORK/kill.h0.out" ||
  fail "kill: host 0's launcher does not name node 1 and rank 3: $(grep 'fsdp-run:' "$WORK/kill.h0.out" | head -n 3)"
pass "rank 3 killed on host 1: host 0 stopped in $elapsed s (exit $rc0), naming node 1 and rank 3"

# --- 4. the link cut mid-training: --timeout bounds the wait ---------------------------------
launch cut --strategy full_shard --steps 100000 --no-shuffle --timeout 5 --metrics "$WORK/cut.jsonl"
for _ in $(seq 1 600); do
  [[ -f "$WORK/cut.jsonl" && "$(wc -l <"$WORK/cut.jsonl")" -ge 3 ]] && break
  sleep 0.1
done
[[ -f "$WORK/cut.jsonl" && "$(wc -l <"$WORK/cut.jsonl")" -ge 3 ]] || fail "cut: training did not start within 60 s"
sim_host_link 1 down
t0="$(now)"
wait_all
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
sim_host_link 1 up
[[ "${RCS%% *}" != 0 && "${RCS##* }" != 0 ]] || fail "cut: launcher exit codes $RCS, expected both non-zero"
awk -v e="$elapsed" 'BEGIN { exit !(e < 5 + 5 + 3) }' || fail "cut: the hosts took $elapsed s to stop (--timeout 5)"
for h in 0 1; do
  grep -q "failed on rank [0-3] of 4 (world rank [0-3], timeout 5000 ms)" "$WORK/cut.h$h.out" ||
    fail "cut: host $h's ranks do not report the collective timeout of 5000 ms"
done
pass "link cut mid-training with --timeout 5: both hosts stopped within $elapsed s (exit codes $RCS), ranks report the 5000 ms timeout"

# --- 5. the link cut during a checkpoint save ------------------------------------------------
# A save every step, of a model large enough that a save takes a while; the link goes down as
# soon as a save has begun (rank 0 made DIR/step-T.tmp). No rank can finish that save, so it
# must stay a .tmp (save_checkpoint renames only after every rank's files are in), and
# --resume auto must continue from step-(T-1): its step T then equals the cut run's step T.
CUTCK="$WORK/cutck"
CUTFLAGS=(--strategy full_shard --hidden 2048 --no-shuffle --checkpoint-dir "$CUTCK" --checkpoint-every 1
  --keep-checkpoints 2 --resume auto)
t0="$(now)"
launch cutsave "${CUTFLAGS[@]}" --steps 100000 --timeout 5 --metrics "$WORK/cutsave.jsonl"
for _ in $(seq 1 600); do
  [[ -d "$CUTCK/step-2" ]] && break
  sleep 0.1
done
[[ -d "$CUTCK/step-2" ]] || fail "cutsave: no checkpoint step-2 within 60 s"
for _ in $(seq 1 1000); do
  compgen -G "$CUTCK/step-*.tmp" >/dev/null && break
  sleep 0.01
done
sim_host_link 1 down
wait_all
sim_host_link 1 up
[[ "${RCS%% *}" != 0 && "${RCS##* }" != 0 ]] || fail "cutsave: launcher exit codes $RCS, expected both non-zero"
tmp="$(compgen -G "$CUTCK/step-*.tmp")" ||
  fail "cutsave: no interrupted save left in $CUTCK ($(ls "$CUTCK" | tr '\n' ' ')): the cut missed the save it aimed at"
cut_step="${tmp##*/step-}"
cut_step="${cut_step%.tmp}"
[[ ! -e "$CUTCK/step-$cut_step" ]] || fail "cutsave: both step-$cut_step.tmp and step-$cut_step exist"
launch cutresume "${CUTFLAGS[@]}" --steps "$cut_step" --timeout 60 --metrics "$WORK/cutresume.jsonl"
wait_all
[[ "$RCS" == "0 0" ]] || fail "cutsave: resuming after the cut: launcher exit codes $RCS"
grep -q "resumed from $CUTCK/step-$((cut_step - 1)) at step $((cut_step - 1))" "$WORK/cutresume.h0.out" ||
  fail "cutsave: --resume auto did not continue from step-$((cut_step - 1)) (the save of step $cut_step was cut)"
d="$(/usr/bin/python3 -c '
import json, sys
def steps(p):
    return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "eval" not in j}
a, b, t = steps(sys.argv[1]), steps(sys.argv[2]), int(sys.argv[3])
assert sorted(b) == [t], f"resumed steps {sorted(b)}"
assert t in a and a[t] == b[t], f"step {t}: {b[t]!r} after resuming vs {a.get(t)!r} in the cut run"
' "$WORK/cutsave.jsonl" "$WORK/cutresume.jsonl" "$cut_step" 2>&1)" || fail "cutsave: $d"
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }')"
pass "link cut during the save of step $cut_step: left as step-$cut_step.tmp, --resume auto continued from step-$((cut_step - 1)) and step $cut_step's loss is bitwise the cut run's (${elapsed} s)"
echo "all multihost checks passed"
