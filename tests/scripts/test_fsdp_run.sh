#!/usr/bin/env bash
# fsdp-run, the launcher: per-rank environment, output prefixing, fail-fast, signal handling,
# CLI errors, and the agent store it serves under --max-restarts (checked with the TCPStore
# client of FSDP_PYTHON's torch). Runs in about 30 s, most of it Python importing torch; every
# check fails with a message saying what it saw.
set -euo pipefail

FSDP_RUN="${FSDP_BIN_DIR:?set FSDP_BIN_DIR to the bin directory of a build}/fsdp-run"
[[ -x "$FSDP_RUN" ]] || { echo "FAIL: $FSDP_RUN is not an executable (build target fsdp-run)"; exit 1; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
OUT="$WORK/out"
ERR="$WORK/err"
# A marker unique to this run, put in the ranks' command lines so pgrep finds only our ranks.
MARK="$$$RANDOM"

fail() {
  echo "FAIL: $*" >&2
  for f in "$OUT" "$ERR"; do
    [[ -f "$f" ]] && { echo "--- $(basename "$f"):" >&2; cat "$f" >&2; }
  done
  exit 1
}
pass() { echo "ok: $*"; }
source "$(dirname "$0")/lib/expect.sh"
# PY (the build's Python), py_has
# shellcheck source=lib/python.sh
source "$(dirname "$0")/lib/python.sh"
# shellcheck source=lib/skip.sh
source "$(dirname "$0")/lib/skip.sh"
# Runs fsdp-run with stdout/stderr to $OUT/$ERR and sets RC (the script itself keeps going).
run() { RC=0; "$FSDP_RUN" "$@" >"$OUT" 2>"$ERR" || RC=$?; }
# Our own processes whose command line contains $1, after giving them up to 1 s to disappear.
survivors() {
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    pgrep -u "$(id -u)" -f "$1" >/dev/null || return 0
    sleep 0.1
  done
  pgrep -a -u "$(id -u)" -f "$1" || true
}

# wait_ranks PATTERN N: waits up to 5 s until N of our processes match ^PATTERN.
wait_ranks() {
  for _ in $(seq 50); do
    [[ "$(pgrep -u "$(id -u)" -fc "^$1")" == "$2" ]] && return 0
    sleep 0.1
  done
  fail "$2 ranks did not start within 5 s"
}

# --- 1. environment per rank ---------------------------------------------------------------
run --nproc 3 -- sh -c 'echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $TORCHELASTIC_USE_AGENT_STORE"'
expect_eq "$RC" 0 "exit code when every rank exits 0"
expect_eq "$(wc -l <"$OUT" | tr -d ' ')" 3 "number of stdout lines for 3 ranks"
port="$(awk 'NR == 1 { print $7 }' "$OUT")"
[[ "$port" =~ ^[0-9]+$ && "$port" -gt 0 ]] || fail "MASTER_PORT should be a picked port, got '$port'"
for r in 0 1 2; do
  expect_eq "$(grep -c "^\[rank$r\]: " "$OUT")" 1 "lines prefixed [rank$r]"
  expect_eq "$(grep "^\[rank$r\]: " "$OUT")" "[rank$r]: $r 3 $r 3 127.0.0.1 $port False" "rank $r environment"
done
[[ ! -s "$ERR" ]] || fail "nothing should be written to stderr on success"

run --nproc 2 --master-addr 10.1.2.3 --master-port=29555 -- sh -c \
  'echo "$GROUP_RANK $GROUP_WORLD_SIZE $ROLE_RANK $ROLE_WORLD_SIZE $ROLE_NAME $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $TORCHELASTIC_RUN_ID $OMP_NUM_THREADS $MASTER_ADDR:$MASTER_PORT"'
expect_eq "$RC" 0 "exit code with explicit master address"
expect_eq "$(grep '^\[rank1\]: ' "$OUT")" "[rank1]: 0 1 1 2 default 0 0 none 1 10.1.2.3:29555" "torchrun variables of rank 1"
RC=0; OMP_NUM_THREADS=7 RANK=99 "$FSDP_RUN" --nproc 1 -- sh -c 'echo "$OMP_NUM_THREADS $RANK"' >"$OUT" 2>"$ERR" || RC=$?
expect_eq "$(cat "$OUT")" "[rank0]: 7 0" "OMP_NUM_THREADS kept when set, RANK always replaced"
pass "environment per rank"

# --- 2. stderr lines are prefixed and stay on stderr; partial last lines are flushed --------
run --nproc 2 -- sh -c 'echo "out $RANK"; echo "err $RANK" >&2; printf "tail $RANK"; printf "etail $RANK" >&2'
expect_eq "$RC" 0 "exit code"
for r in 0 1; do
  expect_contains "$OUT" "[rank$r]: out $r" "stdout of rank $r"
  expect_contains "$OUT" "[rank$r]: tail $r" "partial last stdout line of rank $r"
  expect_contains "$ERR" "[rank$r]: err $r" "stderr of rank $r"
  expect_contains "$ERR" "[rank$r]: etail $r" "partial last stderr line of rank $r"
done
! grep -q "err" "$OUT" || fail "stderr lines leaked to stdout"
! grep -q "out" "$ERR" || fail "stdout lines leaked to stderr"
grep -v '^\[rank[01]\]: ' "$OUT" "$ERR" && fail "every line should carry a rank prefix"
# Many lines from several ranks at once: every line arrives whole, with its prefix.
run --nproc 3 -- sh -c 'i=0; while [ $i -lt 2000 ]; do echo "line-$RANK-$i-abcdefghijklmnopqrstuvwxyz"; i=$((i+1)); done'
expect_eq "$(grep -cE '^\[rank([012])\]: line-\1-[0-9]+-abcdefghijklmnopqrstuvwxyz$' "$OUT")" 6000 "whole, correctly prefixed lines under load"
pass "stderr prefixed and kept apart; lines whole"

# --- 3. fail-fast: one rank fails, the others are stopped -------------------------------------
start="$(now)"
run --nproc 3 -- sh -c "if [ \"\$RANK\" = 1 ]; then echo 'rank one gives up' >&2; exit 3; fi; sleep 60.$MARK"
took="$(elapsed_since "$start")"
expect_eq "$RC" 3 "exit code is the failing rank's"
less_than "$took" 5 || fail "fsdp-run took ${took}s to stop after rank 1 failed (limit 5 s)"
grep -qE '^fsdp-run: rank 1 \(pid [0-9]+\) exited with code 3; stopping 2 other ranks$' "$ERR" \
  || fail "failure message should name rank 1 and its exit code"
expect_contains "$ERR" "[rank1]: rank one gives up" "the failing rank's own message"
left="$(survivors "60.$MARK")"
[[ -z "$left" ]] || fail "ranks still running after fsdp-run exited: $left"
pass "fail-fast in ${took}s"

# --- 3b. a rank on another path: the flight recorder's divergence, once for the job ----------
run --nproc 2 -- "$FSDP_BIN_DIR/dist_smoke" --skip-rank 1 --timeout-ms 5000
[[ "$RC" != 0 ]] || fail "dist_smoke --skip-rank 1 should fail"
records="$(grep -c 'collective record (rank ' "$ERR" || true)"
expect_eq "$records" 1 "the divergence is printed once for the job, not once per rank"
grep -q "is at all_gather #" "$ERR" && grep -q "is at reduce_scatter #" "$ERR" ||
  fail "the divergence should name rank 0's all_gather and rank 1's reduce_scatter"
pass "a rank on another path: the divergence printed once"

# A rank that ignores SIGTERM (and so do its subprocesses) is SIGKILLed after the grace period.
start="$(now)"
# Rank 0 fails only once rank 1 ignores SIGTERM (the ready file), or SIGTERM could win the race.
run --nproc 2 --grace-seconds 1 -- sh -c "if [ \"\$RANK\" = 0 ]; then
    while [ ! -e '$WORK/ready' ]; do sleep 0.02; done; exit 5
  fi
  trap '' TERM; touch '$WORK/ready'; sleep 61.$MARK; echo survived"
took="$(elapsed_since "$start")"
expect_eq "$RC" 5 "exit code with a TERM-ignoring rank"
less_than "$took" 4 || fail "SIGKILL after --grace-seconds 1 took ${took}s"
grep -qE '^fsdp-run: rank 1 \(pid [0-9]+\) still running 1 s after SIGTERM; sending SIGKILL$' "$ERR" \
  || fail "escalation to SIGKILL should be reported"
! grep -q survived "$OUT" || fail "the TERM-ignoring rank was not killed"
left="$(survivors "61.$MARK")"
[[ -z "$left" ]] || fail "TERM-ignoring processes survived: $left"
pass "grace period then SIGKILL in ${took}s"

# --- 4. a rank killed by a signal ------------------------------------------------------------
run --nproc 2 -- sh -c "if [ \"\$RANK\" = 1 ]; then kill -9 \$\$; fi; sleep 62.$MARK"
expect_eq "$RC" 137 "exit code is 128+9 for a rank killed by SIGKILL"
grep -qE '^fsdp-run: rank 1 \(pid [0-9]+\) was killed by signal 9 \(SIGKILL\); stopping 1 other rank$' "$ERR" \
  || fail "signal death should be reported with the signal's name"
pass "rank killed by a signal"

# --- 5. SIGTERM to fsdp-run stops every rank within the grace period -------------------------
"$FSDP_RUN" --nproc 3 --grace-seconds 2 -- sh -c "trap 'echo got TERM; exit 0' TERM; sleep 63.$MARK & wait" >"$OUT" 2>"$ERR" &
launcher=$!
wait_ranks "sleep 63.$MARK" 3
start="$(now)"
kill -TERM "$launcher"
RC=0; wait "$launcher" || RC=$?
took="$(elapsed_since "$start")"
expect_eq "$RC" 143 "exit code after SIGTERM (128+15)"
less_than "$took" 2 || fail "stopping after SIGTERM took ${took}s (grace period 2 s)"
expect_contains "$ERR" "fsdp-run: received SIGTERM; forwarding it to 3 running ranks" "signal report"
expect_eq "$(grep -c 'got TERM' "$OUT")" 3 "every rank should see the forwarded SIGTERM"
left="$(survivors "63.$MARK")"
[[ -z "$left" ]] || fail "processes survived SIGTERM to fsdp-run: $left"
pass "SIGTERM forwarded, stopped in ${took}s"

# If fsdp-run itself is SIGKILLed, its ranks and their subprocesses die with it.
"$FSDP_RUN" --nproc 2 -- sh -c "sleep 64.$MARK; echo done" >"$OUT" 2>"$ERR" &
launcher=$!
wait_ranks "sleep 64.$MARK" 2
# (braces: keep bash's "Killed" job report out of the test log)
{ kill -KILL "$launcher"; wait "$launcher" || true; } 2>/dev/null
left="$(survivors "64.$MARK")"
[[ -z "$left" ]] || fail "ranks outlived a SIGKILLed fsdp-run: $left"
pass "nothing outlives a killed fsdp-run"

# --- 6. command-line errors -------------------------------------------------------------------
expect_usage_error() {
  local what="$1" needle="$2"; shift 2
  run "$@"
  expect_eq "$RC" 2 "exit code for $what"
  expect_contains "$ERR" "$needle" "message for $what"
}
expect_usage_error "--nproc 0" "fsdp-run: --nproc must be at least 1, got 0" --nproc 0 -- true
expect_usage_error "--nproc abc" "--nproc expects a whole number of ranks, got 'abc'" --nproc abc -- true
expect_usage_error "missing --" "put '--' before the command" --nproc 2 true
expect_usage_error "no -- at all" "missing '--' before the command" --nproc 2
expect_usage_error "nothing after --" "missing command after '--'" --nproc 2 --
expect_usage_error "unknown option" "unknown option '--nprocs'" --nprocs 2 -- true
expect_usage_error "missing value" "option '--master-port' needs a value" --master-port
expect_usage_error "bad port" "--master-port expects a port in 0..65535" --master-port 70000 -- true
expect_usage_error "bad grace" "--grace-seconds expects a number of seconds in 0..1000000" --grace-seconds -1 -- true
expect_usage_error "elastic nnodes" "--nnodes 1:2: elastic node counts (MIN:MAX) are not supported; give the exact number of nodes" --nnodes 1:2 --master-port 29500 -- true
expect_usage_error "node rank out of range" "--node-rank 2 is outside 0..1 (--nnodes 2)" --nnodes 2 --node_rank 2 --master-port 29500 -- true
expect_usage_error "bad restarts" "--max-restarts expects a count in 0..1000, got 'x'" --max-restarts x -- true
expect_usage_error "multi-node without a port" "--nnodes 2 needs --master-port PORT (the same on every node)" --nnodes 2 --node-rank 1 -- true
# torchrun's underscore spellings; one node of a one-node "multi-node" job.
run --nnodes=1 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 -- sh -c 'echo "$RANK $GROUP_RANK $MASTER_PORT"'
expect_eq "$RC" 0 "exit code with underscore spellings"
expect_eq "$(grep '^\[rank1\]: ' "$OUT")" "[rank1]: 1 0 29511" "rank 1 with underscore spellings"

run --nproc 2 -- "fsdp-run-no-such-command-$MARK" arg
expect_eq "$RC" 127 "exit code for a command that does not exist"
expect_eq "$(cat "$ERR")" "fsdp-run: cannot execute 'fsdp-run-no-such-command-$MARK': No such file or directory" "message for a missing command"
printf 'echo hi\n' >"$WORK/not-executable"
chmod 644 "$WORK/not-executable"
run --nproc 1 -- "$WORK/not-executable"
expect_eq "$RC" 126 "exit code for a file that is not executable"
expect_contains "$ERR" "fsdp-run: cannot execute '$WORK/not-executable': Permission denied" "message for a non-executable file"

run --help
expect_eq "$RC" 0 "exit code for --help"
expect_contains "$OUT" "usage: fsdp-run" "--help text"
# What fsdp::Trainer checks before it re-executes under fsdp-run (test_trainer_launch compares
# it with the library's own).
run --version
expect_eq "$RC" 0 "exit code for --version"
[[ "$(cat "$OUT")" =~ ^fsdp-run\ [0-9]+\.[0-9]+\.[0-9]+\ \(build\ [0-9a-z-]+\)$ ]] ||
  fail "--version printed '$(cat "$OUT")', want 'fsdp-run X.Y.Z (build ID)'"
pass "command-line errors"

# --- 7. the agent store (--max-restarts) speaks libtorch's TCPStore protocol ------------------
# The client is c10d's own (the Python torch of FSDP_PYTHON: its TCPStore is the same code every
# C++ rank runs): every request type Python exposes (set, get, add, compare_set, check, wait
# with and without a timeout, num_keys, delete_key, append, multi_get, multi_set, the queue
# requests, list_keys, and barrier where the torch has it), WAITs released by another rank's
# SET and queue push, a WAIT that times out (CANCEL_WAIT), and a store that outlives the first
# attempt (attempt 1 reads what attempt 0 wrote). Runs with any torch 2.x wheel:
# FSDP_PYTHON=/path/to/venv/bin/python.
if ! py_has torch.distributed; then
  skip_part "agent store: $PY has no torch ($PY_MISSING)"
else
  cat >"$WORK/store_client.py" <<'PYEOF'
import datetime, os, sys, time
import torch.distributed as dist
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True", os.environ["TORCHELASTIC_USE_AGENT_STORE"]
s = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                  timeout=datetime.timedelta(seconds=20))
has_barrier = hasattr(s, "barrier")  # torch >= 2.15
# Keys attempt 0 leaves (Python's TCPStore adds "/" to each; list_keys takes it off again).
kept = {"count", "cs", "late", "log", "m1", "m2"} | ({"met"} if has_barrier else set())
if attempt == 0:
    total = s.add("count", 1)
    assert total in (1, 2), total
    if has_barrier:
        s.barrier("met", 2)  # both ranks are here
    if rank == 0:
        assert s.compare_set("cs", "", "first") == b"first"
        assert s.compare_set("cs", "wrong", "x") == b"first"
        assert s.compare_set("cs", "first", "second") == b"second"
        assert s.compare_set("absent", "expected", "d") == b"expected"
        s.set("tmp", "1")
        assert s.check(["tmp", "cs"]) and not s.check(["tmp", "absent"])
        assert s.delete_key("tmp") and not s.delete_key("tmp")
        s.append("log", "a")
        s.append("log", "bc")
        assert s.get("log") == b"abc", s.get("log")
        s.multi_set(["m1", "m2"], ["x", b"\x00y"])
        assert s.multi_get(["m2", "m1"]) == [b"\x00y", b"x"]
        s.queue_push("q", "one")
        s.queue_push("q", b"two")
        assert s.queue_len("q") == 2 and s.queue_len("none") == 0
        assert s.queue_pop("q") == b"one"
        try:
            s.queue_pop("none", block=False)
            raise AssertionError("queue_pop of an empty queue returned")
        except dist.QueueEmptyError:
            pass
        t0 = time.monotonic()
        try:
            s.wait(["never"], datetime.timedelta(milliseconds=300))
            raise AssertionError("wait for a key nobody sets returned")
        except dist.DistStoreError as e:
            assert "timeout" in str(e), e
        assert time.monotonic() - t0 < 5, "a timed-out wait took long to cancel"
        assert s.get("cs") == b"second"  # the connection still works after CANCEL_WAIT
        print("attempt 0 ok", flush=True)  # before rank 1 can go on and fail
        time.sleep(0.5)  # rank 1 is waiting for "late" by now
        s.set("late", b"\x00v" * 40000)  # 80 kB: arrives in several reads
        time.sleep(0.3)  # and then for a pop of "jobs"
        s.queue_push("jobs", "job")
        time.sleep(60)  # stopped when rank 1 fails
    else:
        s.wait(["late"], datetime.timedelta(seconds=20))
        assert s.get("late") == b"\x00v" * 40000
        assert s.get("cs") == b"second"
        assert s.queue_pop("jobs") == b"job"  # blocks until rank 0 pushes
        print("attempt 0 ok", flush=True)
        sys.exit(3)  # the failure that makes fsdp-run restart both ranks
else:
    s.wait(["count"])
    assert s.get("count") == b"2", s.get("count")  # still there: the store outlived attempt 0
    assert set(s.list_keys()) == kept, s.list_keys()
    assert s.num_keys() == len(kept), s.num_keys()  # queues are not keys
    assert s.queue_len("q") == 1, s.queue_len("q")  # so did the queue
    print(f"attempt {attempt} ok", flush=True)
PYEOF
  run --nproc 2 --max-restarts 1 -- "$PY" "$WORK/store_client.py"
  expect_eq "$RC" 0 "agent store: exit code after one restart"
  expect_eq "$(sort "$OUT" | tr '\n' ' ')" "[rank0]: attempt 0 ok [rank0]: attempt 1 ok [rank1]: attempt 0 ok [rank1]: attempt 1 ok " "agent store: rank output"
  expect_contains "$ERR" "fsdp-run: rank 1 (pid" "agent store: the failure report"
  expect_contains "$ERR" "fsdp-run: restarting all 2 ranks (restart 1 of 1)" "agent store: the restart line"
  ! grep -q "agent store:" "$ERR" || fail "agent store: it complained: $(grep "agent store:" "$ERR")"
  pass "agent store: c10d's TCPStore client ($("$PY" -c 'import torch; print(torch.__version__)')), every request type, across a restart"

  # A client that is not a libtorch 2.x TCPStore client is refused at once, with one line
  # naming it, and the store goes on serving the others. Each raw client prints its own port.
  cat >"$WORK/store_refusals.py" <<'PYEOF'
import datetime, os, socket, struct, time
import torch.distributed as dist
port = int(os.environ["MASTER_PORT"])
VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
def refused(name, payload):
    c = socket.create_connection(("127.0.0.1", port))
    c.settimeout(5)
    print(f"{name} {c.getsockname()[1]}", flush=True)
    t0 = time.monotonic()
    c.sendall(payload)
    try:
        got = c.recv(64)
    except ConnectionResetError:
        got = b""
    except socket.timeout:
        raise AssertionError(f"{name}: still connected after 5 s")
    took = time.monotonic() - t0
    assert got == b"" and took < 2, (name, got, took)
    c.close()
refused("bad-magic", b"\x00" + struct.pack("<I", 0x12345678))
refused("no-handshake", b"\x01" + struct.pack("<Q", 1) + b"k")  # as a libtorch 1.x SET starts
refused("unknown-type", VALIDATE + b"\x63")
c = socket.create_connection(("127.0.0.1", port))  # a raw PING is answered
c.sendall(VALIDATE + b"\x0d" + struct.pack("<I", 0xC0FFEE))
assert c.recv(4) == struct.pack("<I", 0xC0FFEE)
s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
s.set("after", "ok")
assert s.get("after") == b"ok"
PYEOF
  run --nproc 1 --max-restarts 1 -- "$PY" "$WORK/store_refusals.py"
  expect_eq "$RC" 0 "agent store refusals: exit code"
  for case in "bad-magic:opened with magic 0x12345678" "no-handshake:sent request type 1 before VALIDATE" "unknown-type:sent request type 99,"; do
    port="$(sed -n "s/^\[rank0\]: ${case%%:*} //p" "$OUT")"
    [[ -n "$port" ]] || fail "agent store refusals: no port printed for ${case%%:*}"
    grep -q "^fsdp-run: agent store: client 127.0.0.1:$port ${case#*:}.*; disconnecting it$" "$ERR" \
      || fail "agent store refusals: no line for ${case%%:*} (client port $port)"
  done
  expect_eq "$(grep -c "agent store:" "$ERR")" 3 "agent store refusals: lines on stderr"
  pass "agent store: a bad magic, a missing handshake and an unknown request type are refused at once"
fi

echo "PASS: test_fsdp_run"
