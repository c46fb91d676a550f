#!/usr/bin/env bash
# Sets up a fresh machine and runs every test: bootstrap (Debian packages),
# configure, build, ctest. Used by the README and by .ci/run.
#
#   scripts/test.sh [--quick] [CTEST ARGS...]
#
# --quick runs only the quick lane (ctest -L quick: single-process tests of a few seconds each,
# about 20 s on 2 cores once built); other arguments go to ctest. Every test is in one lane: quick,
# multirank or slow (tests/CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

bash scripts/bootstrap.sh
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j "$JOBS"
# Multi-rank tests start their own rank processes; run test binaries one at a
# time so two of them do not compete for the 2 cores and hit timeouts.
# Under CI=true (.ci/run) any skip fails ([Note: skips], tests/harness/skips.h), so the gpu
# label is left out (-LE gpu): those tests would only skip on a CPU machine, and run on a
# GPU machine through scripts/gpu_check.sh.
labels=()
if [[ "${1:-}" == --quick ]]; then
  labels=(-L quick)
  shift
fi
[[ "${CI:-}" == true ]] && labels+=(-LE gpu)
status=0
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 1 "${labels[@]}" "$@" || status=$?
# Every skip and why: ctest prints the output of failed tests only. Script tests
# print "SKIP: <why>"; gtest prints "<file>:<line>: Skipped" and the reason below.
awk '/^[0-9]+\/[0-9]+ Testing: / { test = $3 }
     /^SKIP: / { print "  " test ": " substr($0, 7) }
     skipped { print "  " test ": " $0; skipped = 0 }
     /: Skipped$/ { skipped = 1 }' "$BUILD_DIR/Testing/Temporary/LastTest.log" >"$BUILD_DIR/skipped.txt" || true
if [[ -s "$BUILD_DIR/skipped.txt" ]]; then
  echo "Skipped (each would fail under CI=true or FSDP_REQUIRE_GPU=1; CI=true runs no gpu-labelled test):"
  cat "$BUILD_DIR/skipped.txt"
else
  echo "Skipped: none"
fi
exit "$status"
