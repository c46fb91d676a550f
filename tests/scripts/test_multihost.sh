#!/usr/bin/env bash
# Two simulated hosts x 2 ranks (tests/scripts/lib/sim_hosts.sh: own network, hostname and
# /dev/shm per host), launched the way two machines would be: one `fsdp-run --nnodes 2` per
# host. Gloo between hosts over TCP (no GLOO_SOCKET_IFNAME: each rank must find the address
# that reaches MASTER_ADDR itself), shared memory only inside a host.
#   1. HYBRID_SHARD (shard group = a host) and FULL_SHARD (groups span hosts) train the mlp
#      and match unsharded single-process PyTorch.
#   2. A rank killed on host 1: host 0's launcher and ranks exit non-zero within seconds,
#      naming the dead rank.
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
# sets PIDS.
launch() {
  local name="$1" i
  shift
  PIDS=()
  rm -f "$WORK/$name".h*.out
  for i in 0 1; do
    sim_host_run "$i" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" \
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

# --- 1. training across hosts matches single-process PyTorch --------------------------------
STEPS=10
/usr/bin/python3 "$HERE/lib/mlp_reference.py" "$DATA" $STEPS 64 0.001 >"$WORK/mlp.ref" ||
  fail "the PyTorch reference failed"
for strategy in hybrid_shard full_shard; do
  launch "$strategy" --strategy "$strategy" --steps $STEPS --no-shuffle --timeout 60 \
    --metrics "$WORK/$strategy.jsonl"
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

# --- 2. a rank killed on host 1 stops host 0 within seconds ----------------------------------
# The pid of the fsdp-train process with RANK=$2 running on host $1.
rank_pid() {
  local pid
  for pid in $(ip netns pids "$(sim_ns "$1")"); do
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == fsdp-train ]] || continue
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=$2" && { echo "$pid"; return 0; }
  done
  return 1
}
launch kill --strategy hybrid_shard --steps 100000 --no-shuffle --timeout 60 --log-every 1 \
  --metrics "$WORK/kill.jsonl"
for _ in $(seq 1 600); do
  [[ -f "$WORK/kill.jsonl" && "$(wc -l <"$WORK/kill.jsonl")" -ge 3 ]] && break
  sleep 0.1
done
[[ -f "$WORK/kill.jsonl" && "$(wc -l <"$WORK/kill.jsonl")" -ge 3 ]] || fail "kill: training did not start within 60 s"
victim="$(rank_pid 1 3)" || fail "kill: no fsdp-train with RANK=3 on host 1"
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
echo "all multihost checks passed"
