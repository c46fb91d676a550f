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
# shellcheck source=lib/planted.sh
source "$(dirname "$0")/lib/planted.sh"

if out=$(check "$LIST"); then
  echo "$out"
else
  echo "FAIL: scripts/gpu_targets.txt does not fit the gpu tests of $BUILD:"
  echo "$out"
  status=1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep -vx 'fsdp-run' "$LIST" >"$work/without-fsdp-run.txt"
expect_fails without-fsdp-run.txt "gpu test test_fsdp_train_cuda needs fsdp-run" check "$work/without-fsdp-run.txt"
{ cat "$LIST"; echo fsdp-ckpt; } >"$work/with-fsdp-ckpt.txt"
expect_fails with-fsdp-ckpt.txt "lists fsdp-ckpt, which no gpu test needs" check "$work/with-fsdp-ckpt.txt"

((status == 0)) && echo "PASS: test_gpu_targets"
exit "$status"
