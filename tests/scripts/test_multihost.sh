#!/usr/bin/env bash
# Two simulated hosts x 2 ranks (tests/scripts/lib/sim_hosts.sh: own network, hostname and
# /dev/shm per host), launched the way two machines would be: one `fsdp-run --nnodes 2` per
# host. Gloo between hosts over TCP (no GLOO_SOCKET_IFNAME: each rank must find the address
# that reaches MASTER_ADDR itself), shared memory only inside a host.
#   1. Every strategy trains the mlp and matches unsharded single-process PyTorch with the
#      one-host tolerances (losses within 1e-6, final weights within 1e-5 rel. L2), each
#      started the way the README says: HYBRID_SHARD (shard group = a host) and FULL_SHARD
#      (groups span hosts) under fsdp-run, SHARD_GRAD_OP as srun starts ranks (the Slurm
#      variables, no launcher process), NO_SHARD under torchrun --nnodes 2. The FSDP trace
#      shows HYBRID_SHARD's shard group on shared memory and its replica all-reduce on TCP
#      (Gloo), and FULL_SHARD on Gloo throughout.
#      A rank on another host advertising loopback (GLOO_SOCKET_IFNAME=lo) is refused at once.
#   2. --keep-checkpoints and --resume auto (a corrupted newest checkpoint is passed over).
#   3. A rank killed on host 1: host 0's launcher and ranks exit non-zero within seconds,
#      naming the dead rank.
#   4. The link cut mid-training: --timeout 5 bounds how long every rank waits.
#   5. The link cut during a checkpoint save: the interrupted save is left as DIR/step-S.tmp,
#      never as a complete-looking DIR/step-S; --resume auto takes the one before it and
#      continues bitwise as the cut run did.
#   6. The checkpoint saved by 2 hosts x 2 ranks loads on one host at N=3 and continues.
#   7. A checkpoint directory on node-local storage (each host mounts its own directory at
#      the same path): the save fails at its start on every rank, naming the ranks that do
#      not see the directory and the fix; nothing is left behind.
# (Section 0 checks multi-node fsdp-run itself: environment, agreement, a lost launcher.)
# Needs root (namespaces): as another user it prints SKIP; under CI=true it fails instead.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=lib/two_hosts.sh
source "$HERE/lib/two_hosts.sh"
require_tools fsdp-run fsdp-train fsdp-ckpt
require_fashion_mnist
# One thread per rank (OpenMP and MKL): 4 ranks share the 2 cores.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# launch NAME ARGS...: one fsdp-run per host in the background, output in $WORK/NAME.h<i>.out;
# sets PIDS. HOST1_ENV=NAME=VALUE adds one variable on host 1 only, BOTH_ENV=NAME=VALUE one
# on both hosts; PRIVATE_DIR=D bind-mounts $WORK/NAME.local.h<i> over D on host i (inside the
# host's own mount namespace: node-local storage at the same path on both machines).
launch() {
  local name="$1" i
  shift
  PIDS=()
  rm -f "$WORK/$name".h*.out
  for i in 0 1; do
    local extra=(env)
    [[ $i == 1 && -n "${HOST1_ENV:-}" ]] && extra+=("$HOST1_ENV")
    [[ -n "${BOTH_ENV:-}" ]] && extra+=("$BOTH_ENV")
    if [[ -n "${PRIVATE_DIR:-}" ]]; then
      mkdir -p "$WORK/$name.local.h$i"
      extra+=(sh -c 'mount --bind "$0" "$1" && shift && exec "$@"' "$WORK/$name.local.h$i" "$PRIVATE_DIR")
    fi
    sim_host_run "$i" "${extra[@]}" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" \
      --master-port "$PORT" --nproc-per-node 2 -- "$BIN/fsdp-train" "$@" >"$WORK/$name.h$i.out" 2>&1 &
    PIDS+=($!)
  done
}
# srun_like NAME ARGS...: what `srun --nodes 2 --ntasks-per-node 2 fsdp-train ARGS` starts: no
# launcher, on each host two ranks with the variables srun sets (and MASTER_ADDR, which the
# README asks for where node names do not resolve). Output in $WORK/NAME.r<rank>.out; sets
# PIDS (one per host; its status is non-zero when one of its ranks failed).
srun_like() {
  local name="$1" h
  shift
  PIDS=()
  for h in 0 1; do
    sim_host_run "$h" env SLURM_NTASKS=4 SLURM_NNODES=2 SLURM_NODEID="$h" SLURM_TASKS_PER_NODE='2(x2)' \
      SLURM_JOB_NODELIST='simhost[0-1]' MASTER_ADDR="${SIM_ADDR[0]}" MASTER_PORT="$PORT" bash -c '
        first=$1 out=$2
        shift 2
        for l in 0 1; do
          SLURM_PROCID=$((first + l)) SLURM_LOCALID=$l "$@" >"$out.r$((first + l)).out" 2>&1 &
        done
        rc=0
        for p in $(jobs -p); do wait "$p" || rc=$?; done
        exit $rc' _ $((2 * h)) "$WORK/$name" "$BIN/fsdp-train" "$@" &
    PIDS+=($!)
  done
}
# torchrun_launch NAME ARGS...: `torchrun --nnodes 2 --node_rank I ...` on each host (the
# static rendezvous: node 0's torchrun serves the store). Output and PIDS as launch's.
torchrun_launch() {
  local name="$1" i
  shift
  PIDS=()
  for i in 0 1; do
    sim_host_run "$i" "${TORCHRUN[@]}" --nnodes 2 --node_rank "$i" --master_addr "${SIM_ADDR[0]}" --master_port "$PORT" \
      --nproc_per_node 2 --no_python \
      "$BIN/fsdp-train" "$@" >"$WORK/$name.h$i.out" 2>&1 &
    PIDS+=($!)
  done
}
# Waits for the processes of launch (or srun_like, torchrun_launch); sets RCS ("rc0 rc1 ...").
wait_all() {
  local p rc
  RCS=""
  for p in "${PIDS[@]}"; do
    rc=0
    wait "$p" || rc=$?
    RCS="${RCS:+$RCS }$rc"
  done
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
wait_for 10 host_pid 1 sleep >/dev/null || true
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

# --- 1. every strategy across hosts matches single-process PyTorch ---------------------------
# The one-host tolerances: losses within 1e-6 relative (test_fsdp_train.sh, where float sums run
# in another order than the reference's) and final weights within 1e-5 relative L2 per tensor
# (test_fsdp_parity). Global batch 48: it divides by 4 ranks here and by 3 in section 5.
STEPS=10
BATCH=48
REF="$WORK/ref"
mkdir -p "$REF"
"$PY" "$HERE/lib/mlp_reference.py" "$DATA" $((2 * STEPS)) $BATCH 0.001 "$REF" >"$WORK/mlp.ref" ||
  fail "the PyTorch reference failed"
# same_as_reference NAME METRICS CHECKPOINT STEPS [FIRST]: the losses of steps FIRST..STEPS (default
# 1) in METRICS and the weights in CHECKPOINT (after STEPS steps) against the reference; prints
# the largest differences.
same_as_reference() {
  "$BIN/fsdp-ckpt" consolidate "$3" "$WORK/$1.pt" >/dev/null || fail "$1: fsdp-ckpt consolidate $3 failed"
  "$PY" -c '
import json, sys, torch
metrics, ref, got_pt, want_pt, steps, first = sys.argv[1:5] + [int(x) for x in sys.argv[5:7]]
a = {j["step"]: j["loss"] for j in map(json.loads, open(metrics)) if "eval" not in j}
b = [float(l) for l in open(ref)]
assert sorted(a) == list(range(first, steps + 1)), f"steps {sorted(a)}, expected {first}..{steps}"
rel = {s: abs(a[s] - b[s - 1]) / abs(b[s - 1]) for s in a}
bad = [f"step {s}: {a[s]!r} vs {b[s - 1]!r}" for s in a if rel[s] >= 1e-6]
assert not bad, "losses differ from PyTorch by 1e-6 or more: " + "; ".join(bad)
got, want = torch.load(got_pt), torch.load(want_pt)
assert list(got) == list(want), f"parameters {list(got)} vs {list(want)}"
w = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
assert max(w.values()) < 1e-5, f"weights after step {steps} differ from PyTorch: rel. L2 {w}"
print("losses %.2g, weights %.2g" % (max(rel.values()), max(w.values())))
' "$2" "$WORK/mlp.ref" "$WORK/$1.pt" "$REF/step-$4.pt" "$4" "${5:-1}"
}
# check_transports NAME EXPECTED: the trace files of the run's 4 ranks; EXPECTED maps each kind
# of collective span to the transport it must name, e.g. "all_gather=shm reduce=shm
# replica_all_reduce=gloo"; every kind listed occurs on every rank, no other kind occurs.
check_transports() {
  "$PY" -c '
import glob, json, sys
want = dict(kv.split("=") for kv in sys.argv[2].split())
files = sorted(glob.glob(sys.argv[1] + "/trace_rank*.json"))
assert len(files) == 4, f"{len(files)} trace files in {sys.argv[1]}"
for f in files:
    seen = {}
    for e in json.load(open(f))["traceEvents"]:
        if e["ph"] != "X" or e["tid"] not in (1, 2):
            continue  # metadata, compute spans and phases
        name, got = e["name"], e["args"].get("transport")
        kind = name.split(" ")[0]
        assert kind in want, f"{f}: unexpected collective span {e}"
        assert got == want[kind], f"{f}: {name} ran on {got}, expected {want[kind]}"
        seen[kind] = seen.get(kind, 0) + 1
    assert set(seen) == set(want), f"{f}: spans {seen}, expected kinds {sorted(want)}"
print(" ".join(f"{k} {n}" for k, n in sorted(seen.items())))
' "$WORK/trace.$1" "$2"
}
# The hybrid run also checkpoints (see sections 2 and 5): 20 steps, all compared here.
CK="$WORK/ckpt"
CKFLAGS=(--checkpoint-dir "$CK" --checkpoint-every 5 --keep-checkpoints 2 --resume auto)
COMMON=(--no-shuffle --batch-size "$BATCH" --timeout 60)
for strategy in hybrid_shard full_shard shard_grad_op no_shard; do
  flags=(--strategy "$strategy" "${COMMON[@]}" --metrics "$WORK/$strategy.jsonl")
  steps=$STEPS
  if [[ $strategy == hybrid_shard ]]; then
    steps=$((2 * STEPS))
    flags+=(--steps "$steps" "${CKFLAGS[@]}")
    final="$CK/step-$steps"
  else
    flags+=(--steps "$steps" --checkpoint-dir "$WORK/ck.$strategy")
    final="$WORK/ck.$strategy/step-$steps"
  fi
  case $strategy in
    hybrid_shard | full_shard)
      how="fsdp-run"
      BOTH_ENV="FSDP_TRACE=$WORK/trace.$strategy" launch "$strategy" "${flags[@]}"
      wait_all
      [[ "$RCS" == "0 0" ]] || fail "$strategy: launcher exit codes (host 0, host 1) = $RCS";;
    shard_grad_op)
      how="srun's variables"
      srun_like "$strategy" "${flags[@]}"
      wait_all
      [[ "$RCS" == "0 0" ]] || fail "$strategy (Slurm variables): exit codes (host 0, host 1) = $RCS";;
    no_shard)
      how="torchrun"
      if py_has torch.distributed.run; then
        torchrun_launch "$strategy" "${flags[@]}"
      else
        [[ "${CI:-}" == true ]] && fail "$PY has no torchrun (torch.distributed.run) and CI=true ($PY_MISSING)"
        echo "note: $PY has no torchrun ($PY_MISSING): NO_SHARD started with fsdp-run instead"
        how="fsdp-run"
        launch "$strategy" "${flags[@]}"
      fi
      wait_all
      [[ "$RCS" == "0 0" ]] || fail "$strategy ($how): exit codes (host 0, host 1) = $RCS";;
  esac
  d="$(same_as_reference "$strategy" "$WORK/$strategy.jsonl" "$final" $steps 2>&1)" ||
    fail "$strategy on 2 hosts x 2 ranks ($how): $d"
  pass "$strategy on 2 hosts x 2 ranks ($how): $steps losses and the final weights match unsharded PyTorch (max rel. diff $d)"
done
# Which transport moved each collective, as the transport that took it reports it in the trace.
d="$(check_transports hybrid_shard "all_gather=shm reduce=shm replica_all_reduce=gloo" 2>&1)" ||
  fail "hybrid_shard trace: $d"
pass "hybrid_shard trace: on every rank the shard group's all-gathers and reduce-scatters ran on shared memory, the replica all-reduce on Gloo/TCP (rank 3: $d)"
d="$(check_transports full_shard "all_gather=gloo reduce=gloo" 2>&1)" || fail "full_shard trace: $d"
pass "full_shard trace: its groups span the hosts, every collective ran on Gloo/TCP (rank 3: $d)"

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
launch resumed --strategy hybrid_shard --steps $((2 * STEPS)) "${COMMON[@]}" \
  --metrics "$WORK/resumed.jsonl" "${CKFLAGS[@]}"
wait_all
[[ "$RCS" == "0 0" ]] || fail "resume auto: launcher exit codes $RCS"
grep -q "resumed from $CK/step-15 at step 15" "$WORK/resumed.h0.out" || fail "resume auto: no 'resumed from $CK/step-15' line"
grep -q "resume auto: skipped: --resume $CK/step-20: unreadable metadata.json" "$WORK/resumed.h0.out" ||
  fail "resume auto: the corrupted step-20 is not reported"
d="$("$PY" -c '
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
wait_for 60 has_lines "$WORK/kill.jsonl" 3 || fail "kill: training did not start within 60 s"
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
wait_for 60 has_lines "$WORK/cut.jsonl" 3 || fail "cut: training did not start within 60 s"
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
wait_for 60 test -d "$CUTCK/step-2" || fail "cutsave: no checkpoint step-2 within 60 s"
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
d="$("$PY" -c '
import json, sys
def steps(p):
    return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "eval" not in j}
a, b, t = steps(sys.argv[1]), steps(sys.argv[2]), int(sys.argv[3])
assert sorted(b) == [t], f"resumed steps {sorted(b)}"
assert t in a and a[t] == b[t], f"step {t}: {b[t]!r} after resuming vs {a.get(t)!r} in the cut run"
' "$WORK/cutsave.jsonl" "$WORK/cutresume.jsonl" "$cut_step" 2>&1)" || fail "cutsave: $d"
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }')"
pass "link cut during the save of step $cut_step: left as step-$cut_step.tmp, --resume auto continued from step-$((cut_step - 1)) and step $cut_step's loss is bitwise the cut run's (${elapsed} s)"

# --- 6. the 2-host checkpoint continues on one host at N=3 -------------------------------------
# step-15, saved by 2 hosts x 2 ranks under HYBRID_SHARD (sections 1 and 2), loaded by 3 ranks on
# host 0 with the same flags (the shard group is then the 3 ranks): steps 16-20 and the weights
# after step 20 against the unsharded reference, with the same tolerances as section 1.
RC=0
sim_host_run 0 "$BIN/fsdp-train" --nproc 3 --strategy hybrid_shard "${COMMON[@]}" --steps $((2 * STEPS)) \
  --resume "$CK/step-15" --checkpoint-dir "$WORK/ck.n3" --metrics "$WORK/n3.jsonl" >"$WORK/n3.out" 2>&1 || RC=$?
[[ $RC == 0 ]] || fail "N=3 on one host from the 2-host checkpoint: exit $RC"
grep -q "resumed from $CK/step-15 at step 15" "$WORK/n3.out" || fail "N=3: no 'resumed from $CK/step-15 at step 15' line"
d="$(same_as_reference n3 "$WORK/n3.jsonl" "$WORK/ck.n3/step-$((2 * STEPS))" $((2 * STEPS)) 16 2>&1)" ||
  fail "N=3 on one host from the 2-host checkpoint: $d"
pass "step-15 of 2 hosts x 2 ranks continued on one host at N=3: steps 16-20 and the final weights match unsharded PyTorch (max rel. diff $d)"

# --- 7. a checkpoint directory on node-local storage -----------------------------------------
# Each host bind-mounts a directory of its own over the same path, as two machines with local
# disks would see it. The step-0 save fails at its start on every rank (before training and
# before any tensor is written) naming the ranks that cannot see rank 0's directory, and
# neither host's disk keeps anything.
PRIV="$WORK/ck.local"
mkdir -p "$PRIV"
t0="$(now)"
PRIVATE_DIR="$PRIV" launch local --strategy hybrid_shard "${COMMON[@]}" --steps 5 --checkpoint-dir "$PRIV"
wait_all
elapsed="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
[[ "${RCS%% *}" != 0 && "${RCS##* }" != 0 ]] || fail "node-local checkpoint directory: exit codes $RCS, expected both non-zero"
awk -v e="$elapsed" 'BEGIN { exit !(e < 30) }' || fail "node-local checkpoint directory: took $elapsed s to fail (limit 30 s)"
pid='\[pid [0-9]+ on simhost'
grep -Eq "save_checkpoint: '$PRIV/step-0' is not one directory for all ranks: rank 0 ${pid}0\] wrote a probe file into '$PRIV/step-0.tmp', but rank 2 ${pid}1\] \(No such file or directory\), rank 3 ${pid}1\] \(No such file or directory\) do not see it" "$WORK/local.h0.out" &&
  grep -q "must be on a file system shared by all nodes, mounted at the same path on each" "$WORK/local.h0.out" ||
  fail "node-local checkpoint directory: host 0 does not name ranks 2 and 3 on simhost1 and the fix"
left="$(find "$WORK/local.local.h0" "$WORK/local.local.h1" -mindepth 1)"
[[ -z "$left" ]] || fail "node-local checkpoint directory: files left behind: $left"
pass "checkpoint directory on node-local storage: the first save failed at its start in $elapsed s on both hosts, naming ranks 2 and 3 on simhost1 and the fix; nothing left on either disk"
echo "all multihost checks passed"
