#!/usr/bin/env bash
# scripts/gpu_targets.txt, all that `scripts/gpu_check.sh -L gpu` builds, is exactly what this
# build's gpu-labelled tests need (scripts/check_gpu_targets.py against `ctest -L gpu`), and the
# check finds, in copies of the list, a needed target left out and a target no gpu test needs.
set -euo pipefail
SRC="${FSDP_SOURCE_DIR:?set FSDP_SOURCE_DIR to the source tree}"
BUILD=$(cd "${FSDP_BIN_DIR:?set FSDP_BIN_DIR to the bin directory of a build}/.." && pwd)
PY="${FSDP_PYTHON:-python3}"
LIST="$SRC/scripts/gpu_targets.txt"
check() { "$PY" "$SRC/scripts/check_gpu_targets.py" "$BUILD" "$1" 2>&1; }
status=0

if out=$(check "$LIST"); then
  echo "$out"
else
  echo "FAIL: scripts/gpu_targets.txt does not fit the gpu tests of $BUILD:"
  echo "$out"
  status=1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# plant NAME EXPECTED: the check fails on $work/NAME with a line containing EXPECTED.
plant() {
  local out
  if out=$(check "$work/$1"); then
    echo "FAIL: the check passes $1"
    status=1
  elif grep -qF "$2" <<<"$out"; then
    echo "ok: $1: $(grep -F "$2" <<<"$out" | head -1)"
  else
    echo "FAIL: $1: the check fails without saying '$2':"
    echo "$out"
    status=1
  fi
}
grep -vx 'fsdp-run' "$LIST" >"$work/without-fsdp-run.txt"
plant without-fsdp-run.txt "gpu test test_fsdp_train_cuda needs fsdp-run"
{ cat "$LIST"; echo fsdp-ckpt; } >"$work/with-fsdp-ckpt.txt"
plant with-fsdp-ckpt.txt "lists fsdp-ckpt, which no gpu test needs"

((status == 0)) && echo "PASS: test_gpu_targets"
exit "$status"
