#!/usr/bin/env bash
# Every launcher fsdp::comm understands, end to end with tools/examples/dist_smoke.cpp:
#   (a) fsdp-run with 2 and 3 ranks
#   (b) torchrun: --standalone (c10d rendezvous, MASTER_ADDR=localhost) and the static
#       rendezvous, whose agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True)
#   (c) OpenMPI and Slurm variables set by hand on bare processes (Slurm: master "localhost")
#   (d) fail-fast without a launcher: a rank exits, the others fail with the library's error
#   (e) fail-fast under fsdp-run: the launcher names the failed rank and stops the job
#   (f) a rank that hangs: the others fail by the collective timeout
# Every process runs under `timeout`, so the script cannot hang; it takes ~20-30 s.
set -euo pipefail

BIN="${FSDP_BIN_DIR:?set FSDP_BIN_DIR to the bin directory of a build}"
SMOKE="$BIN/dist_smoke"
FSDP_RUN="$BIN/fsdp-run"
# PY, TORCHRUN (the build's Python and its torchrun), py_has
# shellcheck source=lib/python.sh
source "$(dirname "$0")/lib/python.sh"
# shellcheck source=lib/skip.sh
source "$(dirname "$0")/lib/skip.sh"
for exe in "$SMOKE" "$FSDP_RUN"; do
  [[ -x "$exe" ]] || { echo "FAIL: $exe is not an executable (build targets dist_smoke, fsdp-run)"; exit 1; }
done

WORK="$(mktemp -d)"
BG_PIDS=()
cleanup() {
  for pid in "${BG_PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  for f in "$WORK"/*.out "$WORK"/*.err; do
    [[ -s "$f" ]] && { echo "--- $(basename "$f"):" >&2; head -c 4000 "$f" >&2; }
  done
  exit 1
}
pass() { echo "ok: $*"; }
source "$(dirname "$0")/lib/expect.sh"
reset_logs() { rm -f "$WORK"/*.out "$WORK"/*.err; }

# A free TCP port on loopback (the kernel picks it; a tiny race with other jobs is accepted).
free_port() {
  if command -v "$PY" >/dev/null; then
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
    return
  fi
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
  fail "no free port found by probing"
}

# The line rank R prints on success; $5 is agent_store (0/1).
smoke_line() { echo "dist_smoke rank=$1 world=$2 local_rank=$3 source=$4 agent_store=$5 allreduce=$2 ok"; }

# start_bare NAME SECONDS ENV... -- ARGS... : one rank as a bare background process (no
# launcher) with ENV added, output in $WORK/NAME.out/.err, killed after SECONDS. Sets PID.
start_bare() {
  local name=$1 limit=$2; shift 2
  local envs=()
  while [[ $# -gt 0 && "$1" != "--" ]]; do envs+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  # Launchers' variables from the caller's environment must not leak into a bare rank.
  env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT \
      -u SLURM_PROCID -u SLURM_NTASKS -u SLURM_LOCALID -u SLURM_JOB_NODELIST \
      -u SLURM_NODELIST -u SLURM_NTASKS_PER_NODE -u SLURM_TASKS_PER_NODE \
      -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_LOCAL_RANK \
      -u OMPI_COMM_WORLD_LOCAL_SIZE -u TORCHELASTIC_USE_AGENT_STORE \
      "${envs[@]}" timeout -k 2 "$limit" "$SMOKE" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PID=$!
  BG_PIDS+=("$PID")
}
# Sets RC to the exit code of background pid $1 (never hangs: every process runs under
# `timeout`). Not usable in $(...): a subshell cannot wait for its parent's children.
rc_of() { RC=0; wait "$1" || RC=$?; }

# --- (a) fsdp-run ---------------------------------------------------------------------------
for n in 2 3; do
  reset_logs
  rc=0; timeout -k 2 30 "$FSDP_RUN" --nproc "$n" -- "$SMOKE" >"$WORK/fsdprun.out" 2>"$WORK/fsdprun.err" || rc=$?
  expect_eq "$rc" 0 "fsdp-run --nproc $n -- dist_smoke: exit code"
  expect_eq "$(wc -l <"$WORK/fsdprun.out" | tr -d ' ')" "$n" "fsdp-run --nproc $n: stdout lines"
  for ((r = 0; r < n; r++)); do
    expect_eq "$(grep -c "^\[rank$r\]: " "$WORK/fsdprun.out")" 1 "fsdp-run --nproc $n: lines of rank $r"
    expect_eq "$(grep "^\[rank$r\]: " "$WORK/fsdprun.out")" "[rank$r]: $(smoke_line "$r" "$n" "$r" torchrun 0)" \
      "fsdp-run --nproc $n: line of rank $r"
  done
done
pass "(a) fsdp-run --nproc 2 and 3: every rank checked all_reduce, all_gather_into, reduce_scatter"

# --- (b) torchrun ---------------------------------------------------------------------------
# --standalone uses the c10d rendezvous (MASTER_ADDR=localhost); torch 1.13 had rank 0 serve
# the store there (TORCHELASTIC_USE_AGENT_STORE=False), 2.x has the agent serve it (True).
# The static rendezvous (--master-addr/--master-port, no --rdzv-backend) has the agent serve
# the store, TORCHELASTIC_USE_AGENT_STORE=True: all ranks connect as clients under
# /worker/attempt_0. Both are checked.
if ! py_has torch.distributed.run; then
  skip_part "(b) $PY has no torchrun (torch.distributed.run; $PY_MISSING); torchrun checks skipped"
else
  check_torchrun_lines() {  # $1 = description, $2 = expected agent_store or "any"
    local r line
    for r in 0 1; do
      line="$(grep -o "dist_smoke rank=$r .*" "$WORK/torchrun.out" || true)"
      expect_eq "$(grep -c "dist_smoke rank=$r " "$WORK/torchrun.out")" 1 "$1: lines of rank $r"
      if [[ "$2" == any ]]; then
        [[ "$line" == "$(smoke_line "$r" 2 "$r" torchrun 0)" || "$line" == "$(smoke_line "$r" 2 "$r" torchrun 1)" ]] ||
          fail "$1: line of rank $r is '$line'"
      else
        expect_eq "$line" "$(smoke_line "$r" 2 "$r" torchrun "$2")" "$1: line of rank $r"
      fi
    done
  }
  reset_logs
  rc=0
  timeout -k 5 60 "${TORCHRUN[@]}" --standalone --nproc_per_node 2 --no_python \
    "$SMOKE" >"$WORK/torchrun.out" 2>"$WORK/torchrun.err" || rc=$?
  expect_eq "$rc" 0 "torchrun --standalone: exit code"
  check_torchrun_lines "torchrun --standalone" any
  standalone_agent="$(grep -o 'agent_store=[01]' "$WORK/torchrun.out" | sort -u | tr '\n' ' ')"
  pass "(b) torchrun --standalone --nproc_per_node 2 (${standalone_agent% })"

  reset_logs
  rc=0
  timeout -k 5 60 "${TORCHRUN[@]}" --nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 \
    --master_port "$(free_port)" --no_python \
    "$SMOKE" >"$WORK/torchrun.out" 2>"$WORK/torchrun.err" || rc=$?
  expect_eq "$rc" 0 "torchrun static rendezvous: exit code"
  check_torchrun_lines "torchrun static rendezvous" 1
  pass "(b) torchrun static rendezvous --nproc_per_node 2: agent_store=1, ranks were store clients"
fi

# --- (c) OpenMPI and Slurm variables on bare processes ----------------------------------------
# bare_pair NAME SOURCE LABEL VARS_FN: ranks 0 and 1 as bare processes with the variables
# `VARS_FN RANK PORT` prints (one fresh port for the pair); both must exit 0 printing the smoke
# line of launcher source SOURCE.
bare_pair() {
  local name=$1 source=$2 label=$3 vars_fn=$4 port r
  reset_logs
  port="$(free_port)"
  pids=()
  for r in 0 1; do
    # shellcheck disable=SC2046 # VARS_FN prints NAME=VALUE words
    start_bare "$name$r" 20 $("$vars_fn" "$r" "$port") --
    pids+=("$PID")
  done
  for r in 0 1; do
    rc_of "${pids[$r]}"
    expect_eq "$RC" 0 "$label rank $r: exit code"
    expect_eq "$(cat "$WORK/$name$r.out")" "$(smoke_line "$r" 2 "$r" "$source" 0)" "$label rank $r: output"
  done
}
ompi_vars() {
  echo "OMPI_COMM_WORLD_RANK=$1 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=$1 OMPI_COMM_WORLD_LOCAL_SIZE=2 MASTER_PORT=$2"
}
slurm_vars() { echo "SLURM_PROCID=$1 SLURM_NTASKS=2 SLURM_LOCALID=$1 SLURM_JOB_NODELIST=localhost MASTER_PORT=$2"; }
bare_pair ompi openmpi OpenMPI ompi_vars
pass "(c) OpenMPI variables (OMPI_COMM_WORLD_*, MASTER_PORT; master defaults to 127.0.0.1)"
bare_pair slurm slurm Slurm slurm_vars
pass "(c) Slurm variables (SLURM_PROCID/NTASKS/LOCALID, SLURM_JOB_NODELIST=localhost as master)"

# three_bare NAME SMOKE_ARGS...: ranks 0-2 of one job as bare processes (no launcher) on a
# fresh port, output in $WORK/NAME<r>.{out,err}; their pids in PIDS.
three_bare() {
  local name="$1" r port
  shift
  port="$(free_port)"
  PIDS=()
  for r in 0 1 2; do
    start_bare "$name$r" 30 RANK=$r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" -- "$@"
    PIDS+=("$PID")
  done
}
# peers_failed NAME WHEN: ranks 0 and 1 of three_bare NAME exited non-zero by themselves (not
# killed by their timeout) with the library's error; WHEN says after what.
peers_failed() {
  local name="$1" when="$2" r rc
  for r in 0 1; do
    rc_of "${PIDS[$r]}"
    rc=$RC
    [[ "$rc" != 0 && "$rc" != 124 && "$rc" != 137 ]] ||
      fail "rank $r should fail by itself $when, exit code $rc (124/137: killed by timeout)"
    expect_contains "$WORK/$name$r.err" "failed on rank $r of 3" "rank $r's error $when (exit code $rc)"
  done
}

# --- (d) fail-fast, bare processes ------------------------------------------------------------
reset_logs
start=$(now)
three_bare failfast --fail-rank 2 --timeout-ms 5000
rc_of "${PIDS[2]}"
expect_eq "$RC" 3 "--fail-rank 2: exit code of rank 2"
peers_failed failfast "after rank 2 exited"
t="$(elapsed_since "$start")"
less_than "$t" 10 || fail "ranks 0 and 1 took ${t}s to fail after rank 2 exited (timeout 5 s)"
pass "(d) fail-fast without launcher: rank 2 exited 3, ranks 0 and 1 failed with the library's error in ${t}s"

# --- (e) fail-fast under fsdp-run --------------------------------------------------------------
reset_logs
start=$(now)
rc=0
timeout -k 2 30 "$FSDP_RUN" --nproc 3 -- "$SMOKE" --fail-rank 2 --timeout-ms 5000 \
  >"$WORK/fsdprun.out" 2>"$WORK/fsdprun.err" || rc=$?
t="$(elapsed_since "$start")"
[[ "$rc" != 0 && "$rc" != 124 && "$rc" != 137 ]] || fail "fsdp-run with a failing rank: exit code $rc"
less_than "$t" 15 || fail "fsdp-run took ${t}s to stop after rank 2 exited"
grep -qE '^fsdp-run: .*rank 2\b' "$WORK/fsdprun.err" || fail "fsdp-run's report does not name rank 2"
pass "(e) fail-fast under fsdp-run: exit code $rc after ${t}s, '$(grep -E '^fsdp-run: .*rank 2\b' "$WORK/fsdprun.err" | head -1)'"

# --- (f) a hanging rank: the collective timeout fires ---------------------------------------------
reset_logs
start=$(now)
three_bare hang --hang-rank 2 --timeout-ms 2000
peers_failed hang "while rank 2 hangs"
for r in 0 1; do expect_contains "$WORK/hang$r.err" "timeout 2000 ms" "rank $r's error while rank 2 hangs"; done
t="$(elapsed_since "$start")"
kill "${PIDS[2]}" 2>/dev/null || true  # `timeout` passes the TERM on to the hanging rank
rc_of "${PIDS[2]}"
less_than "$t" 12 || fail "ranks 0 and 1 took ${t}s to time out (timeout 2 s)"
pass "(f) hanging rank 2: ranks 0 and 1 failed by the 2 s collective timeout in ${t}s (incl. startup)"
