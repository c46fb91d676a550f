#!/usr/bin/env bash
# What a user sees when a tool fails: one line per error, "<tool>: ..." with the tool's
# name once and no C++ backtrace ("frame #N" lines), unless TORCH_SHOW_CPP_STACKTRACES=1
# asks for it; every benchmark answers --help without running and refuses unknown flags.
# About 20 s.
set -euo pipefail

BIN="${FSDP_BIN_DIR:?set FSDP_BIN_DIR to the bin directory of a build}"
# shellcheck source=lib/python.sh
source "$(dirname "$0")/lib/python.sh"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
OUT="$WORK/out"
ERR="$WORK/err"
fail() {
  echo "FAIL: $*" >&2
  for f in "$OUT" "$ERR"; do
    [[ -f "$f" ]] && { echo "--- $(basename "$f"):" >&2; head -n 40 "$f" >&2; }
  done
  exit 1
}
pass() { echo "ok: $*"; }
# Runs a command with stdout/stderr to $OUT/$ERR and sets RC.
run() { RC=0; "$@" >"$OUT" 2>"$ERR" || RC=$?; }
# no_backtrace <what>: $ERR has no "frame #" and no doubled tool prefix.
no_backtrace() {
  ! grep -q "frame #" "$ERR" || fail "$1: the message carries a C++ backtrace"
  ! grep -qE "^(\[rank[0-9]+\]: )?([a-z_-]+): (error: )?\2: " "$ERR" || fail "$1: the tool's name is printed twice"
}

# --- fsdp-ckpt ------------------------------------------------------------------------------
run "$BIN/fsdp-ckpt" inspect "$WORK/no/such/dir"
[[ $RC == 1 ]] || fail "fsdp-ckpt inspect of a missing directory: exit $RC, expected 1"
[[ "$(cat "$ERR")" == "fsdp-ckpt: '$WORK/no/such/dir/metadata.json' does not exist (not a checkpoint, or an incomplete save)" ]] ||
  fail "fsdp-ckpt inspect of a missing directory: unexpected message"
no_backtrace "fsdp-ckpt inspect"
pass "fsdp-ckpt inspect /no/such/dir: one line, one prefix, no backtrace"
TORCH_SHOW_CPP_STACKTRACES=1 run "$BIN/fsdp-ckpt" inspect "$WORK/no/such/dir"
grep -q "frame #" "$ERR" || fail "TORCH_SHOW_CPP_STACKTRACES=1 did not show the backtrace"
[[ "$(grep -c "^fsdp-ckpt: " "$ERR")" == 1 ]] || fail "TORCH_SHOW_CPP_STACKTRACES=1: expected one 'fsdp-ckpt: ' line"
pass "fsdp-ckpt with TORCH_SHOW_CPP_STACKTRACES=1: the backtrace is shown"

# --- fsdp-train: an error raised on the ranks (a checkpoint with a flipped byte) ------------
run "$BIN/fsdp-train" --steps 1 --no-shuffle --checkpoint-dir "$WORK/ck"
[[ $RC == 0 ]] || fail "fsdp-train --checkpoint-dir: exit $RC"
shard="$(find "$WORK/ck/step-1" -type f ! -name metadata.json | sort | head -n 1)"
[[ -n "$shard" ]] || fail "no data file in $WORK/ck/step-1"
printf '\xff' | dd of="$shard" bs=1 seek=100 conv=notrunc status=none
run "$BIN/fsdp-train" --steps 2 --no-shuffle --resume "$WORK/ck/step-1"
[[ $RC != 0 ]] || fail "--resume from a corrupted checkpoint exited 0"
grep -q "fsdp-train: error: " "$ERR" || fail "--resume from a corrupted checkpoint: no 'fsdp-train: error: ' line"
no_backtrace "fsdp-train --resume (corrupted)"
pass "fsdp-train --resume of a corrupted checkpoint: $(grep -m1 -o 'fsdp-train: error: .\{0,80\}' "$ERR")..."

# --- fsdp-train: the survivor of a killed peer -----------------------------------------------
# Two ranks started by hand (no launcher to stop the survivor); rank 1 is SIGKILLed once
# rank 0 has trained a few steps. Rank 0 must fail naming rank 1, in one line, no backtrace.
port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
pids=()
for r in 0 1; do
  (export RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port
   exec "$BIN/fsdp-train" --steps 100000 --log-every 1 >"$WORK/rank$r.out" 2>"$WORK/rank$r.err") &
  pids+=($!)
done
stop_ranks() { kill -9 "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; }
for _ in $(seq 1 600); do grep -q "^step 3/" "$WORK/rank0.err" 2>/dev/null && break; sleep 0.1; done
grep -q "^step 3/" "$WORK/rank0.err" || { stop_ranks; ERR="$WORK/rank0.err" fail "the two ranks did not train 3 steps in 60 s"; }
kill -9 "${pids[1]}"
wait "${pids[1]}" 2>/dev/null || true
SECONDS=0
while kill -0 "${pids[0]}" 2>/dev/null && (( SECONDS < 60 )); do sleep 0.1; done
took=$SECONDS
stop_ranks
ERR="$WORK/rank0.err"
(( took < 10 )) || fail "rank 0 did not stop within 10 s of rank 1's death (${took} s)"
grep -q "^fsdp-train: error: .*gone: rank 1" "$ERR" || fail "rank 0 did not name the dead rank 1"
no_backtrace "the survivor of a killed peer"
pass "a survivor of a killed peer: $(grep -m1 -o '^fsdp-train: error: .\{0,60\}' "$ERR")... (no backtrace)"

# --- benchmarks -----------------------------------------------------------------------------
for b in bench_adam bench_async_checkpoint bench_checkpoint bench_collectives bench_memory_tracer bench_safetensors_load \
  bench_strategies; do
  [[ -x "$BIN/$b" ]] || fail "$BIN/$b is missing (build every target)"
  SECONDS=0
  run "$BIN/$b" --help
  [[ $RC == 0 ]] || fail "$b --help: exit $RC"
  grep -q "^usage: $b" "$OUT" || fail "$b --help: no usage line"
  (( SECONDS < 5 )) || fail "$b --help took ${SECONDS}s: did it run the benchmark?"
  run "$BIN/$b" --no-such-flag
  [[ $RC == 2 ]] || fail "$b --no-such-flag: exit $RC, expected 2"
  grep -q "^$b: unknown argument.*--no-such-flag" "$ERR" || fail "$b --no-such-flag: no 'unknown argument' message"
  no_backtrace "$b --no-such-flag"
done
pass "every benchmark: --help prints its usage, an unknown flag exits 2 naming it"
echo "all tool error checks passed"
