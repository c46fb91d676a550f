#!/usr/bin/env bash
# Sets up a fresh machine and runs every test: bootstrap (Debian packages),
# configure, build, ctest. Used by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

bash scripts/bootstrap.sh
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j "$JOBS"
# Multi-rank tests start their own rank processes; run test binaries one at a
# time so two of them do not compete for the 2 cores and hit timeouts.
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 1 "$@"
